"""Run the Slurm recipe on a real one-node Slurm: ``nox -s slurm`` (needs root).

    python tools/slurm_check.py --prepare   # print why it cannot run ('' if it can), after
                                            # installing Debian's slurm-wlm and munge if missing
    python tools/slurm_check.py [--tasks 2 4]

Starts munged (as the munge user), slurmctld and slurmd with a configuration in a temporary
directory (own ports, one node with this machine's cores, OverSubscribe=FORCE:4, no cgroups),
submits ``examples/cluster/train.sbatch`` with each number of tasks (``sbatch --wait``), runs the
same training under ``ferrorun --nproc N``, and checks that both report the same final loss and
that the Slurm job's ranks joined one job (``init_from_env`` detected srun). The daemons are
stopped by their pid files and the directory is removed, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "cluster" / "train.sbatch"
TRAIN = ROOT / "examples" / "train_mlp.py"
#: the training both launchers run: small, float64 (so the comparison is exact), a checkpoint
TRAIN_ARGS = ["--dataset", "digits", "--epochs", "2", "--dtype", "float64",
              "--strategy", "full_shard", "--batch-size", "96"]
DAEMONS = ("slurmd", "slurmctld", "munged")


def log(msg: str) -> None:
    print(f"[slurm_check] {msg}", flush=True)


def prepare() -> str:
    """'' when this machine can run the check (installing slurm-wlm and munge with apt-get if
    they are missing), else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (slurmd and munged run as root / the munge user)"
    missing = [d for d in ("slurmctld", "slurmd", "sbatch", "munged") if not shutil.which(d)]
    if missing and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        missing = [d for d in ("slurmctld", "slurmd", "sbatch", "munged") if not shutil.which(d)]
    if missing:
        return (f"Debian's slurm-wlm and munge are not installed ({', '.join(missing)} missing) "
                "and apt-get could not install them")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it)"
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A one-node Slurm in ``tmp``; :meth:`stop` ends its daemons by their pid files."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.node = socket.gethostname().split(".")[0]
        self.conf = tmp / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.pids = {d: tmp / f"{d}.pid" for d in DAEMONS}

    def start(self) -> None:
        tmp = self.tmp
        munge = tmp / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ent = pwd.getpwnam("munge")
        for p in (munge, key):
            os.chown(p, ent.pw_uid, ent.pw_gid)
        tmp.chmod(0o755)
        self.socket = munge / "munge.socket"
        subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force",
                        f"--socket={self.socket}", f"--key-file={key}",
                        f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                        f"--seed-file={munge / 'munged.seed'}"], check=True, timeout=30)
        self.pids["munged"] = munge / "munged.pid"
        for d in ("state", "spool"):
            (tmp / d).mkdir()
        cpus = os.cpu_count() or 1
        self.conf.write_text(f"""\
ClusterName=ferro
SlurmctldHost={self.node}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={tmp / 'state'}
SlurmdSpoolDir={tmp / 'spool'}
SlurmctldPidFile={self.pids['slurmctld']}
SlurmdPidFile={self.pids['slurmd']}
SlurmctldLogFile={tmp / 'slurmctld.log'}
SlurmdLogFile={tmp / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
NodeName={self.node} CPUs={cpus} State=UNKNOWN
PartitionName=ferro Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        subprocess.run(["slurmctld", "-c"], env=self.env, check=True, timeout=60)
        subprocess.run(["slurmd"], env=self.env, check=True, timeout=60)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, text=True,
                                 capture_output=True, timeout=30).stdout.strip()
            if out in ("idle", "mixed", "allocated"):
                log(f"one-node Slurm up: node {self.node}, {cpus} CPUs, state {out}, "
                    f"config {self.conf}")
                return
            time.sleep(0.5)
        raise RuntimeError(f"the node never became idle (sinfo: {out!r}); slurmctld log:\n"
                           + (tmp / "slurmctld.log").read_text()[-3000:])

    def stop(self) -> None:
        for d in DAEMONS:
            pidfile = self.pids[d]
            try:
                pid = int(pidfile.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            end = time.monotonic() + 15
            while time.monotonic() < end:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            log(f"stopped {d} (pid {pid})")

    def sbatch(self, ntasks: int, ckpt: Path, out: Path, extra_env: dict[str, str]) -> str:
        cmd = ["sbatch", "--parsable", "--ntasks", str(ntasks), "--overcommit", "--chdir",
               str(ROOT), "--output", str(out), "--time", "10", str(SBATCH), *TRAIN_ARGS]
        env = dict(self.env, CKPT=str(ckpt), PYTHON=sys.executable, FERRO_REPO=str(ROOT),
                   **extra_env)
        t0 = time.monotonic()
        job = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=60,
                             check=True).stdout.strip().split(";")[0]
        # poll the job's state (sbatch --wait backs off to 30 s+ between its own polls)
        state, code = "PENDING", "?"
        while time.monotonic() - t0 < 600:
            info = subprocess.run(["scontrol", "-o", "show", "job", job], env=self.env,
                                  text=True, capture_output=True, timeout=30).stdout
            fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
            state, code = fields.get("JobState", "?"), fields.get("ExitCode", "?")
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "?"):
                break
            time.sleep(0.5)
        text = out.read_text() if out.exists() else ""
        log(f"sbatch --ntasks {ntasks}: job {job} {state} (exit code {code}) in "
            f"{time.monotonic() - t0:.1f}s")
        if state != "COMPLETED":
            raise RuntimeError(f"the Slurm job ended {state} ({code}):\n{text[-4000:]}")
        return text


def final_loss(text: str, what: str) -> float:
    for line in text.splitlines():
        if "summary: " in line:
            return json.loads(line.split("summary: ", 1)[1])["final_loss"]
    raise RuntimeError(f"{what}: no summary line in its output:\n{text[-4000:]}")


def ferrorun(ntasks: int, ckpt: Path) -> str:
    cmd = [sys.executable, "-m", "ferro_backend.launch", "--nproc", str(ntasks), str(TRAIN),
           "--checkpoint-dir", str(ckpt), "--checkpoint-every", "25", "--no-progress",
           *TRAIN_ARGS]
    r = subprocess.run(cmd, text=True, capture_output=True, timeout=600, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"ferrorun failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def run(tasks: list[int]) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="ferro-slurm-"))
    cluster = Cluster(tmp)
    failures = 0
    try:
        cluster.start()
        for n in tasks:
            text = cluster.sbatch(n, tmp / f"ckpt-slurm-{n}", tmp / f"job-{n}.out",
                                  {"FERRO_LOG_LEVEL": "info"})
            slurm = final_loss(text, f"sbatch --ntasks {n}")
            topology = [ln.strip() for ln in text.splitlines()
                        if "started by" in ln or ln.strip().startswith(("ShmBackend:",
                                                                           "TcpBackend:",
                                                                           "node ", "links"))]
            for ln in topology:
                log(f"  {ln}")
            ckpts = sorted(p.name for p in (tmp / f"ckpt-slurm-{n}").glob("step_*"))
            local = final_loss(ferrorun(n, tmp / f"ckpt-ferrorun-{n}"), f"ferrorun --nproc {n}")
            same = slurm == local
            joined = any(f"{n} ranks on 1 node" in ln for ln in topology)
            log(f"{n} tasks: final loss under srun {slurm!r}, under ferrorun {local!r}: "
                f"{'equal' if same else 'DIFFERENT'}; one job of {n} ranks: {joined}; "
                f"checkpoints {ckpts}")
            failures += (not same) + (not joined) + (not ckpts)
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"removed {tmp}")
    log("OK" if not failures else f"FAILED ({failures} checks)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", action="store_true",
                   help="install what is missing; print why the check cannot run ('' if it can)")
    p.add_argument("--tasks", type=int, nargs="+", default=[2, 4])
    args = p.parse_args(argv)
    if args.prepare:
        print(prepare())
        return 0
    reason = prepare()
    if reason:
        log(f"cannot run: {reason}")
        return 2
    return run(args.tasks)


if __name__ == "__main__":
    sys.exit(main())
