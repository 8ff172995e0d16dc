"""Where a job may touch the node's files: sandbox, shipped workdirs, mounts, /dev/shm, snapshot memory."""
