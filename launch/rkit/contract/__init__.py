"""The contract between the two sides, and nothing else: the run directory's paths, event vocabulary and atomic
writes (rundir), JSON-lines reading that survives damaged files (safeio), the typed config every module reads (config)
and the schema with its defaults (defaults, schema/), errors (errors), canonical JSON, the config hash and redaction
(stamp), the heartbeat's signed datagram (heartbeat).

Image side (with runtime/): these files are in the image cache key and in the agent rkit binds into images that
lack it. Imports nothing of rkit but itself (tests/unit/test_layering.py)."""
