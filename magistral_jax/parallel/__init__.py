"""Device meshes and logical-axis sharding rules."""
