"""Device meshes and logical-axis sharding rules, the processes of a run (multihost, liveness,
local_cluster), the transfers between them (bulk, weight_transfer), and the patch that lets a
CPU program's compile-cache entry serve any devices (cache_key_patch)."""
