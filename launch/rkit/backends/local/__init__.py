"""The local launcher: one process per rank on this machine, in the image or not (launcher), and its warm
standbys (standby)."""
