"""What runs inside the image: the agent each rank runs (agent) and its warm standby (standby), device and
determinism set-up (devices, determinism), JAX's compile cache as a restart finds it (compilecache), fault
injection (inject), the environment capture (manifest), MaxText's hooks (trainers/), node telemetry and the exporter
(telemetry/), and the image build's helpers (imageinfo, debianlock, envscan).

Image side (with contract/). Imports only contract/ and itself (tests/unit/test_layering.py); the host side may
import it."""
