"""Small shared helpers, each module one concern: errors, files, devices, the process group, the hub."""
