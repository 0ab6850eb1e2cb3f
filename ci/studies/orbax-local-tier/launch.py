"""Launch N worker processes for one phase; SIGKILL them all when train is done.

usage: launch.py phase N base R s0 s1 logtag  (env passes through: MGR, INIT_IDS, ...)
"""
import os, sys, time, socket, signal, subprocess

phase, N, base, R, s0, s1, tag = sys.argv[1:8]
N = int(N)
TIMEOUT = int(os.environ.get("PHASE_TIMEOUT", "150"))
PY = sys.executable  # the venv with jax and orbax-checkpoint: .venv/bin/python launch.py ...
here = os.path.dirname(os.path.abspath(__file__))
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.makedirs(f"{here}/logs", exist_ok=True)
procs, logs = [], []
for i in range(N):
  lf = f"{here}/logs/{tag}.p{i}.log"
  logs.append(lf)
  f = open(lf, "w")
  procs.append(subprocess.Popen([PY, f"{here}/worker.py", phase, str(N), str(i), str(port), base, R, s0, s1],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
t0 = time.time()
status = "timeout"
while time.time() - t0 < TIMEOUT:
  time.sleep(1)
  texts = [open(l).read() for l in logs]
  if phase == "train" and all("READY_TO_DIE" in t for t in texts):
    status = "all_ready_killed"; break
  if all(p.poll() is not None for p in procs):
    status = "all_exited"; break
for p in procs:  # SIGKILL only our own children, by pid
  if p.poll() is None:
    os.kill(p.pid, signal.SIGKILL)
for p in procs:
  p.wait()
print(f"== {tag} phase={phase} N={N} R={R} status={status} wall={time.time()-t0:.0f}s rcs={[p.returncode for p in procs]}")
for i, l in enumerate(logs):
  for line in open(l):
    if line.startswith("[p") or "Error" in line[:200] and "Traceback" not in line:
      print(f"  p{i}: {line.rstrip()[:600]}")
