"""The trainers rkit drives; MaxText is the one: its step directories, their integrity check and quarantine, the
keys rkit owns, TensorBoard routing."""
