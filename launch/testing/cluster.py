"""A real two-node Slurm cluster on this machine, for tests (tests/slurm, `make test-slurm`).

    python -m launch.testing.cluster up       # install the packages if missing, start, wait for idle nodes
    python -m launch.testing.cluster up --no-accounting   # the same without slurmdbd and MariaDB (CI's pair)
    python -m launch.testing.cluster status   # sinfo
    python -m launch.testing.cluster env      # `eval "$(python -m launch.testing.cluster env)"`: PATH, SLURM_CONF
    python -m launch.testing.cluster down     # stop everything, remove the namespaces and the state

What it builds (root only; Debian's slurmctld, slurmd and slurm-client 22.05, munge; slurmdbd and mariadb-server
for accounting):
- two network namespaces, asyncpp-node1 and asyncpp-node2, each with one veth (`slurm0`) on a bridge
  (`asyncpp-br`) that has no address: 10.77.31.11 and .12 exist only inside the namespaces, and nothing is
  routed out of them. Each namespace sees its own /etc/hosts (/etc/netns/<ns>/hosts: node1, node2).
- one munged (root namespace; its socket is a file, which both namespaces see);
- slurmctld and slurmd `node1` in asyncpp-node1, slurmd `node2` in asyncpp-node2, each slurmd in a UTS
  namespace of its own, so `hostname` on a node says node1 or node2, as on a real cluster;
- client wrappers (sbatch, srun, squeue, scontrol, scancel, sinfo, sacct) in <state>/bin: from the root
  namespace they run the command inside asyncpp-node1 (the "login node" is the head node), inside a node they
  run it directly. Put <state>/bin first on PATH and set SLURM_CONF (`env()`), and `launch.slurm` submits here.

No cgroups (proctrack/linuxproc, task/none: a container's cgroup tree is not slurm's). Accounting is real:
slurmdbd on node1 over a MariaDB that listens on a unix socket only, so `sacct -D` shows every start of a job
(a requeued one has a REQUEUED row and then its final one). `--no-accounting` leaves both out (8 s of start-up
and, on a machine without them, ~60 s of packages: what CI's two tests skip); slurmctld's own job completion log
(jobcomp/filetxt) is kept either way and has a line for every end of a run, a requeue's included.

`up()` first tears down whatever an earlier run left, so it is idempotent; `down()` kills every process in
the two namespaces (jobs included), the daemons by their pid files, and removes all it made. `Cluster.running()`
is the cluster an earlier `up` left running (tests/slurm use it instead of starting their own).
No torch import: the launcher tests import this.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STATE = Path(os.environ.get("ASYNCPP_SLURM_STATE", "/run/asyncpp-slurm"))
BRIDGE = "asyncpp-br"
SUBNET = "10.77.31"  # private; the addresses live only inside the namespaces this module creates
NODES = ("node1", "node2")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "sacct", "sacctmgr", "salloc")
# Debian's packages, without their recommendations (slurm-wlm's pull in 36 more: -dev headers, plugins for
# GPUs, InfluxDB, HDF5...), and the programs each set provides.
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
ACCOUNTING_PACKAGES = ("slurmdbd", "mariadb-server")
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "munged")
ACCOUNTING_PROGRAMS = ("slurmdbd", "mariadbd", "mariadb-install-db")
DAEMONS = ("slurmctld", "slurmd", "munged", "slurmdbd", "mariadbd", "mariadb-install-db")


def namespace(node: str) -> str:
    return f"asyncpp-{node}"


def address(node: str) -> str:
    return f"{SUBNET}.{10 + NODES.index(node) + 1}"


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=True, **kw)


@dataclass(frozen=True)
class Cluster:
    state: Path = STATE
    cpus_per_node: int = 1
    """What each node offers (config_overrides): the 2 cores of this machine, one per node."""
    slurmd_timeout: int = 10
    """Seconds before a silent node is DOWN (300 by default): the node-death test waits for it."""
    cred_expire: int = 5
    """Seconds a requeued job waits before it may start again (120 by default; see slurm_conf)."""
    accounting: bool = True
    """slurmdbd over MariaDB, for sacct (False: slurmctld's job completion log only)."""

    @classmethod
    def running(cls, state: Path = STATE) -> Cluster | None:
        """The cluster an earlier `up` left running here, with its options, or None."""
        conf = state / "slurm.conf"
        if not conf.exists():
            return None
        cluster = cls(state=state, accounting="accounting_storage/slurmdbd" in conf.read_text())
        r = sh(str(cluster.bin_dir / "sinfo"), "-h", "-N", "-o", "%N", check=False)
        return cluster if r.returncode == 0 and sorted(r.stdout.split()) == list(NODES) else None

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    @property
    def bin_dir(self) -> Path:
        return self.state / "bin"

    @property
    def munge_socket(self) -> Path:
        return self.state / "munge" / "munge.socket"

    @property
    def jobcomp_log(self) -> Path:
        return self.state / "jobcomp.log"

    @property
    def last_logs(self) -> Path:
        """Where `down` leaves the daemons' logs (the state directory itself is removed)."""
        return self.state.with_name(self.state.name + "-last-logs")

    def log(self, daemon: str) -> Path:
        return self.state / "log" / f"{daemon}.log"

    def env(self, base: dict | None = None) -> dict:
        """An environment whose sbatch/srun/scontrol/... talk to this cluster."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '')}"
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ---- up ----------------------------------------------------------------------------------------

    def up(self, timeout: float = 60.0) -> Cluster:
        install_packages(self.accounting)
        self.down()
        for sub in ("munge", "log", "ctld", "bin", *(f"spool-{n}" for n in NODES)):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self._network()
        self._munge()
        self.conf.write_text(self.slurm_conf())
        self._wrappers()
        if self.accounting:
            self._accounting()
        self._daemon("slurmctld", "node1", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._daemon(f"slurmd-{node}", node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self.wait_idle(timeout)
        return self

    def _network(self) -> None:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "addrgenmode", "none")  # no IPv6 link-local in the root namespace
        sh("ip", "link", "set", BRIDGE, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{address(n)} {n}\n" for n in NODES)
        for i, node in enumerate(NODES, 1):
            ns, veth = namespace(node), f"asyncpp-v{i}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "slurm0", "netns", ns)
            sh("ip", "link", "set", veth, "addrgenmode", "none")
            sh("ip", "link", "set", veth, "master", BRIDGE)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{address(node)}/24", "dev", "slurm0")
            sh("ip", "-n", ns, "link", "set", "slurm0", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)  # the node's /etc/hosts (bin/on-node; `ip netns exec` too)

    def _munge(self) -> None:
        d = self.state / "munge"
        (d / "key").mkdir(mode=0o700)
        key = d / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sh("munged", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
           f"--pid-file={d / 'munged.pid'}", f"--log-file={self.log('munged')}", f"--seed-file={d / 'seed'}")

    @property
    def mysql_socket(self) -> Path:
        return self.state / "mysql" / "mysqld.sock"

    def _accounting(self) -> None:
        """MariaDB (a unix socket only: --skip-networking) and slurmdbd on node1, so that sacct has the jobs'
        records, requeues included. slurmdbd reaches the database through $MYSQL_UNIX_PORT."""
        data = self.state / "mysql" / "data"
        data.mkdir(parents=True)
        sh("mariadb-install-db", f"--datadir={data}", "--user=root", "--auth-root-authentication-method=socket",
           "--skip-test-db")
        with open(self.log("mariadbd"), "ab") as out:
            proc = subprocess.Popen(["mariadbd", f"--datadir={data}", f"--socket={self.mysql_socket}", "--user=root",
                                     "--skip-networking", f"--pid-file={self.state / 'mysql' / 'mariadbd.pid'}",
                                     "--innodb-buffer-pool-size=16M", "--performance-schema=OFF"],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        (self.state / "mariadbd.daemon-pid").write_text(str(proc.pid))
        _wait(lambda: self.mysql_socket.exists(), 60, f"mariadbd's socket {self.mysql_socket}", self)
        dbd = self.state / "slurmdbd.conf"
        dbd.write_text(f"""# written by launch/testing/cluster.py
DbdHost=node1
DbdAddr={address('node1')}
DbdPort=6819
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={self.state / 'slurmdbd.pid'}
LogFile={self.log('slurmdbd')}
""")
        dbd.chmod(0o600)  # slurmdbd refuses a config others can read
        # slurmdbd has no -f: it reads slurmdbd.conf beside $SLURM_CONF
        self._daemon("slurmdbd", "node1", ["env", f"MYSQL_UNIX_PORT={self.mysql_socket}", f"SLURM_CONF={self.conf}",
                                           "slurmdbd", "-D"])
        sacctmgr = str(self.bin_dir / "sacctmgr")

        def registered() -> bool:  # the cluster is known to slurmdbd (and so slurmdbd answers)
            sh(sacctmgr, "-i", "add", "cluster", "asyncpp", check=False)
            return "asyncpp" in sh(sacctmgr, "-n", "-P", "list", "cluster", "format=cluster", check=False).stdout

        _wait(registered, 60, "slurmdbd to register the cluster", self)

    def slurm_conf(self) -> str:
        s = self.state
        accounting = (
            "AccountingStorageType=accounting_storage/slurmdbd\n"
            "AccountingStorageHost=node1\n"
            "AccountingStoragePort=6819\n"
            "# with slurmdbd this names the munge socket for its connections (AuthInfo does not reach them)\n"
            f"AccountingStoragePass={self.munge_socket}\n"
        ) if self.accounting else "AccountingStorageType=accounting_storage/none\n"
        nodes = "".join(
            f"NodeName={n} NodeAddr={address(n)} CPUs={self.cpus_per_node} RealMemory=4000 State=UNKNOWN\n"
            for n in NODES
        )
        return f"""# written by launch/testing/cluster.py; removed by `python -m launch.testing.cluster down`
ClusterName=asyncpp
SlurmctldHost=node1({address('node1')})
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a job's credential lives, and so how long slurmctld holds a requeued job before it may
# start again (Reason=BeginTime; 120 s by default): a node refuses to relaunch a job whose old credential it
# revoked ("Job credential revoked") until then.
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/spool-%n
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd-%n.pid
SlurmctldLogFile={self.log('slurmctld')}
SlurmdLogFile={s}/log/slurmd-%n.log
# a container's cgroup tree is not slurm's to manage
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
{accounting}JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp_log}
SchedulerType=sched/backfill
# A requeued job becomes eligible again after cred_expire; nothing wakes the scheduler then, and the backfill
# pass that starts it runs every bf_interval (30 s by default): every second here.
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
MinJobAge=600
JobRequeue=1
{nodes}PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _wrappers(self) -> None:
        # on-node NODE CMD...: run CMD on the node. The node's network namespace (nsenter, not `ip netns exec`,
        # which mounts a fresh /sys without /sys/fs/cgroup, and slurmd 22.05 will not start without it), a UTS
        # namespace named after the node and a mount namespace in which the node's hosts file is /etc/hosts.
        on_node = self.bin_dir / "on-node"
        on_node.write_text(
            "#!/bin/sh\n"
            "# launch/testing/cluster.py: on-node NODE CMD... runs CMD on that node\n"
            'node=$1; shift\n'
            'exec nsenter --net=/run/netns/asyncpp-$node unshare --uts --mount --propagation private sh -c '
            '\'mount --bind /etc/netns/asyncpp-$0/hosts /etc/hosts && hostname $0 && exec "$@"\' "$node" "$@"\n'
        )
        on_node.chmod(0o755)
        for name in CLIENTS:
            path = self.bin_dir / name
            path.write_text(
                "#!/bin/sh\n"
                "# launch/testing/cluster.py: on a node run it there; from outside, on the head node\n"
                f"export SLURM_CONF={self.conf}\n"
                'if [ -z "$(ip netns identify $$ 2>/dev/null)" ]; then\n'
                f"    exec {on_node} node1 /usr/bin/{name} \"$@\"\n"
                "fi\n"
                f"exec /usr/bin/{name} \"$@\"\n"
            )
            path.chmod(0o755)

    def _daemon(self, name: str, node: str, cmd: list[str]) -> None:
        """Start `cmd` on the node (bin/on-node), detached; its output goes to <state>/log/<name>.out."""
        with open(self.log(name).with_suffix(".out"), "ab") as out:
            proc = subprocess.Popen([str(self.bin_dir / "on-node"), node, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        (self.state / f"{name}.daemon-pid").write_text(str(proc.pid))

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            r = sh(str(self.bin_dir / "sinfo"), "-h", "-N", "-o", "%N %t", check=False)
            states = r.stdout.strip()
            if r.returncode == 0 and sorted(states.split("\n")) == [f"{n} idle" for n in NODES]:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the nodes are not idle after {timeout:.0f} s: sinfo says {states!r}; logs in "
                           f"{self.state / 'log'}:\n{self.tail_logs()}")

    def tail_logs(self, lines: int = 15) -> str:
        out = []
        for p in sorted((self.state / "log").glob("*")):
            out.append(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    # ---- faults ------------------------------------------------------------------------------------

    def node_pids(self, node: str) -> list[int]:
        """Every process in the node's network namespace (its slurmd, and the jobs' processes)."""
        r = sh("ip", "netns", "pids", namespace(node), check=False)
        return [int(p) for p in r.stdout.split()]

    def kill_node(self, node: str) -> None:
        """The node dies: its slurmd and every process on it get SIGKILL (slurmctld on node1 is spared)."""
        ctld = _read_pid(self.state / "slurmctld.pid")
        for pid in self.node_pids(node):
            if pid != ctld:
                _kill(pid, signal.SIGKILL)

    def start_node(self, node: str) -> None:
        self._daemon(f"slurmd-{node}", node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])

    # ---- down --------------------------------------------------------------------------------------

    def down(self) -> None:
        """Stop everything `up` started (idempotent; a no-op when nothing is there). Returns once the processes it
        killed are gone (a SIGKILLed process lingers a moment, and a check right after `down` saw it)."""
        killed = [pid for node in NODES for pid in self.node_pids(node)]
        for pidfile in (*self.state.glob("*.daemon-pid"), *self.state.glob("*.pid"), self.state / "munge/munged.pid",
                        self.state / "mysql/mariadbd.pid"):
            pid = _read_pid(pidfile)
            if pid is not None and _is_ours(pid):
                killed.append(pid)
        for pid in killed:
            _kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in killed):
            time.sleep(0.05)
        for node in NODES:
            sh("ip", "netns", "del", namespace(node), check=False)
            shutil.rmtree(Path("/etc/netns") / namespace(node), ignore_errors=True)
        sh("ip", "link", "del", BRIDGE, check=False)
        if self.state.exists():
            if (self.state / "log").exists():  # the daemons' logs outlive the cluster, for a post-mortem
                shutil.rmtree(self.last_logs, ignore_errors=True)
                shutil.copytree(self.state / "log", self.last_logs)
            shutil.rmtree(self.state)
        deadline = time.monotonic() + 5  # deleting a namespace takes its veth with it, a moment later
        while time.monotonic() < deadline and sh("ip", "link", "show", "asyncpp-v1", check=False).returncode == 0:
            time.sleep(0.1)

    # ---- job records -------------------------------------------------------------------------------

    def completions(self) -> list[dict]:
        """The job completion log: one dict per end of a job (JobId, JobState, ExitCode, Restarts? ...)."""
        if not self.jobcomp_log.exists():
            return []
        return [dict(f.split("=", 1) for f in line.split() if "=" in f)
                for line in self.jobcomp_log.read_text().splitlines() if line.strip()]


def _wait(predicate, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise RuntimeError(f"no {what} after {timeout:.0f} s; logs in {cluster.state / 'log'}:\n{cluster.tail_logs()}")


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _is_ours(pid: int) -> bool:
    """A pid file may be stale and the pid reused: only kill a munged/slurm/ip process."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return comm in (*DAEMONS, "nsenter", "unshare", "sh", "on-node", "env")


def _alive(pid: int) -> bool:
    """Still a process (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def install_packages(accounting: bool = True) -> None:
    """apt-get install the cluster's packages when a program of theirs is missing (Debian, root). Any failure
    raises, with apt's own words: a cluster that cannot be installed is an error, never a skip."""
    packages = (*PACKAGES, *ACCOUNTING_PACKAGES) if accounting else PACKAGES
    programs = (*PROGRAMS, *ACCOUNTING_PROGRAMS) if accounting else PROGRAMS
    if all(shutil.which(p) for p in programs):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"{', '.join(packages)} are not all installed, and installing them needs root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]):
        r = sh(*cmd, check=False, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    missing = [p for p in programs if not shutil.which(p)]
    if missing:
        raise RuntimeError(f"apt-get installed {', '.join(packages)}, yet {', '.join(missing)} is not on PATH")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.testing.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("up", "down", "status", "env"))
    p.add_argument("--no-accounting", dest="accounting", action="store_false",
                   help="up without slurmdbd and MariaDB (no sacct; slurmctld's job completion log stays)")
    args = p.parse_args(argv)
    cluster = Cluster(accounting=args.accounting)
    if args.action == "up":
        cluster.up()
        print(sh(str(cluster.bin_dir / "sinfo"), "-N").stdout, end="")
    elif args.action == "down":
        cluster.down()
    elif args.action == "status":
        r = sh(str(cluster.bin_dir / "sinfo"), "-N", check=False)
        print(r.stdout or r.stderr, end="")
        return r.returncode
    else:
        print(f"export PATH={cluster.bin_dir}:$PATH SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
