"""The generation side of the RL run: a run's generators (generators), the verifier pool and
group scoring (rollouts), and the many-process roles (remote)."""
