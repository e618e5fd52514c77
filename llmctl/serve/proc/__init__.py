"""Engine processes: the child, its supervisor, replicas and their routing."""
