"""Facts of the machine a process runs on: its CPUs, its networks, its local files, TensorFlow's native log. Pure: imports neither side."""
