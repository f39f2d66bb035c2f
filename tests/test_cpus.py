"""The CPUs a rank can really use: its affinity mask and its cgroup's quota, v1 and v2."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sparktrain.host import cpus
from sparktrain.seam import worker_env


def _tree(root, files: dict[str, str]) -> None:
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)


def test_a_cgroup_v2_quota_anywhere_above_the_process_limits_it(tmp_path):
    _tree(tmp_path, {
        "proc/cgroup": "0::/kubepods/pod1/ctr\n",
        "cg/kubepods/cpu.max": "max 100000\n",
        "cg/kubepods/pod1/cpu.max": "250000 100000\n",  # 2.5 CPUs for the pod
        "cg/kubepods/pod1/ctr/cpu.max": "max 100000\n",
    })
    assert cpus.quota_cpus(str(tmp_path / "proc/cgroup"), str(tmp_path / "cg")) == 2.5


def test_a_cgroup_v1_cfs_quota_limits_it_and_minus_one_does_not(tmp_path):
    _tree(tmp_path, {
        "proc/cgroup": "12:cpuset:/yarn/c1\n4:cpu,cpuacct:/yarn/c1\n",
        "cg/cpu,cpuacct/yarn/cpu.cfs_quota_us": "-1\n",
        "cg/cpu,cpuacct/yarn/cpu.cfs_period_us": "100000\n",
        "cg/cpu,cpuacct/yarn/c1/cpu.cfs_quota_us": "100000\n",
        "cg/cpu,cpuacct/yarn/c1/cpu.cfs_period_us": "100000\n",
    })
    assert cpus.quota_cpus(str(tmp_path / "proc/cgroup"), str(tmp_path / "cg")) == 1.0
    _tree(tmp_path, {"cg/cpu,cpuacct/yarn/c1/cpu.cfs_quota_us": "-1\n"})
    assert cpus.quota_cpus(str(tmp_path / "proc/cgroup"), str(tmp_path / "cg")) is None


@pytest.mark.parametrize("text, expected", [("max", None), ("max 100000", None), ("50000 100000", 0.5),
                                            ("400000 100000", 4.0)])
def test_cpu_max_parsing(text, expected):
    assert cpus.parse_cpu_max(text) == expected


def test_no_cgroup_file_means_no_quota(tmp_path):
    assert cpus.quota_cpus(str(tmp_path / "missing"), str(tmp_path)) is None


def test_the_host_budget_follows_spark_task_cpus_and_what_the_process_can_use():
    assert cpus.host_budget(None, 3, usable=2) == 2
    assert cpus.host_budget(1, 2, usable=8) == 2  # spark.task.cpus=1 and 2 ranks: 2 CPUs, not 8
    assert cpus.rank_threads(4, 2, 2) == 4  # Spark's grant of 4 task CPUs is kept
    assert cpus.rank_threads(None, 2, 2) == 1  # without one, the host's usable CPUs are shared


def test_ranks_confined_to_fewer_cores_than_they_are_do_not_spin():
    """A process whose affinity mask holds one core: two ranks there would outnumber it."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to show the difference")
    code = textwrap.dedent("""
        import os
        from sparktrain.host import cpus
        from sparktrain import engine
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        print(cpus.usable_cpus(), engine.default_spin(1), engine.default_spin(2))
    """)
    env = {k: v for k, v in os.environ.items() if k != worker_env.CPU_BUDGET}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["1", str(cpus_spin()), "0.0"], out.stdout + out.stderr
    # The budget the task measured wins over what the rank process sees after it was pinned.
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(env, **{worker_env.CPU_BUDGET: "2"})).stdout.split()[2] == str(cpus_spin())


def cpus_spin() -> float:
    from sparktrain import engine

    return engine.SPIN_S
