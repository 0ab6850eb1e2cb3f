"""The trainers rkit drives; MaxText is the one: its step directories, their integrity check and quarantine, the
keys rkit owns, TensorBoard routing, the node-local tier (localtier: records and each rank's side; emergency: the
hook that makes MaxText's emergency checkpointing work) and Grain's data position for it (datapos)."""
