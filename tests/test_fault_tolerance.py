"""Fault-tolerant replica groups on torchft, run as a user runs them: ``simplefsdp train --fault-tolerant``.

Two replica groups of one gloo rank each, with torchft's real lighthouse started by our launcher. The jobs run
eagerly (``--no-compile``): quorum, commit and healing sit outside the compiled graphs, and the machine has two
cores; ``benchmarks/fault_tolerance.md`` runs the compiled model.
"""

from __future__ import annotations

import platform
import re

import pytest
import torch

from test_train_cli import _load_full, train
from simplefsdp.cli import main
from simplefsdp.optim import DeMo, DiLoCo
from simplefsdp.runtime.checkpoint import latest_checkpoint
from simplefsdp.runtime.fault_tolerance import ReplicaGroup, check_lighthouse

if platform.machine() != "x86_64":
    pytest.skip("torchft 0.2.0 publishes x86-64 wheels only", allow_module_level=True)

GROUPS = ["--nproc", "1", "--fault-tolerant", "--replica-groups", "2", "--grad-accum", "1", "--max-norm", "1e9"]
# Steps of at least half a second keep the survivor training (60 steps, 30 s) while the killed group restarts
# (about 5 s here: a new process imports torch and torchft, builds the model and joins the quorum).
STEP_SLEEP = 0.5
STEP = re.compile(r"^step +(\d+)/\d+  loss (\S+) .* group (\d) replicas (\d)/2(  not committed)?$", re.M)


def steps(stdout: str, group: int) -> list[tuple[int, str, int, bool]]:
    """(step, printed loss, participants, committed) of each step line of ``group``, in order."""
    return [(int(step), loss, int(k), not uncommitted)
            for step, loss, g, k, uncommitted in STEP.findall(stdout) if int(g) == group]


def checksums(stdout: str) -> dict[int, str]:
    return {int(group): value for group, value in re.findall(r"^group (\d): rank 0's parameter checksum (\w+)$",
                                                             stdout, re.M)}


def test_torchft_is_installed_by_the_ft_extra():
    import torchft  # noqa: F401  the README's commands install simplefsdp[ft]


def test_a_lighthouse_that_cannot_be_reached_is_named_without_hanging():
    with pytest.raises(ConnectionError, match=r"cannot reach the torchft lighthouse at http://127.0.0.1:9 "):
        check_lighthouse("http://127.0.0.1:9", wait_seconds=1)


@pytest.mark.parametrize("options, message", [
    (["--mode", "replicate"], "--fault-tolerant runs fully_shard inside each replica group"),
    (["--replica-groups", "0"], "--replica-groups must be at least 1"),
    (["--replica-sync", "diloco", "--sync-every", "0"],
     "--sync-every, --demo-chunk and --demo-top-k must be at least 1"),
    (["--replica-sync", "diloco", "--outer-momentum", "1"], "--outer-momentum in \\[0, 1\\); got 0.7, 1.0"),
    (["--replica-sync", "demo", "--optimizer", "galore"], "--replica-sync demo brings its own optimizer; drop "),
    (["--outer-quantize", "int8"], "--outer-quantize int8 is for --replica-sync diloco's pseudo-gradient"),
])
def test_bad_fault_tolerant_options_are_rejected_before_any_rank_starts(options, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", "--model", "debug", "--fault-tolerant", *options])


def test_a_replica_group_refuses_an_optimizer_that_does_not_fit_its_sync_mode_before_any_connection():
    model = torch.nn.Linear(2, 2)
    for sync, optimizer in [("demo", torch.optim.AdamW(model.parameters())), ("step", DiLoCo(model.parameters())),
                            ("demo", DiLoCo(model.parameters())), ("every", DeMo(model.parameters()))]:
        with pytest.raises(ValueError, match=f"sync={sync!r} with {type(optimizer).__name__}: 'step' takes"):
            ReplicaGroup(model, optimizer, 0, 2, "http://127.0.0.1:9", sync=sync)


def test_without_failures_two_groups_train_bitwise_like_replicate_on_the_same_global_batch(tmp_path):
    """Two groups of one rank average gradients across groups as ``replicate`` (``hybrid_shard`` with one shard per
    replica) averages over its two ranks: a sum of two gradients, halved, exact in either order; so losses and
    parameters are bitwise equal."""
    groups = train(*GROUPS, "--steps", "4", "--checkpoint-dir", str(tmp_path / "groups"))
    assert groups.returncode == 0, groups.stderr[-3000:]
    replicate = train("--mode", "replicate", "--grad-accum", "1", "--max-norm", "1e9", "--steps", "4",
                      "--checkpoint-dir", str(tmp_path / "replicate"))
    assert replicate.returncode == 0, replicate.stderr[-3000:]
    lines = [steps(groups.stdout, group) for group in (0, 1)]
    for group_lines in lines:
        assert [(step, k, ok) for step, _, k, ok in group_lines] == [(step, 2, True) for step in (1, 2, 3, 4)]
    # Each group prints its own mean loss; both are rounded to 4 decimals, as is replicate's: their mean is within
    # 0.5e-4 of the true mean, so it is within 1e-4 of replicate's printed loss.
    reference = [float(loss) for loss in re.findall(r"^step +\d+/4  loss (\S+)", replicate.stdout, re.M)]
    for (_, loss_0, _, _), (_, loss_1, _, _), expected in zip(*lines, reference, strict=True):
        assert abs((float(loss_0) + float(loss_1)) / 2 - expected) <= 1e-4
    groups_state, replicate_state = (_load_full(latest_checkpoint(tmp_path / name), tmp_path)["model"]
                                     for name in ("groups", "replicate"))
    assert groups_state.keys() == replicate_state.keys()
    for key in groups_state:
        assert torch.equal(groups_state[key], replicate_state[key]), key
    assert len(checksums(groups.stdout)) == 2 and len(set(checksums(groups.stdout).values())) == 1


def test_a_group_killed_mid_run_restarts_heals_and_rejoins_while_the_other_never_stops():
    assert_a_killed_group_heals()


def assert_a_killed_group_heals(*options: str) -> None:
    """Group 1, killed at the end of its third step, restarts, heals from group 0's state and rejoins, while group 0
    steps on; both end with the same parameters."""
    job = train(*GROUPS, *options, "--steps", "60", kill="0:step-end:3:1", step_sleep=STEP_SLEEP, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    survivor, restarted = steps(job.stdout, 0), [(step, ok) for step, _, _, ok in steps(job.stdout, 1)]
    assert [step for step, *_ in survivor] == list(range(1, 61)) and all(ok for *_, ok in survivor)
    participants = [k for _, _, k, _ in survivor]
    assert 1 in participants and 2 in participants[participants.index(1):], \
        f"group 1 did not drop out and rejoin before group 0 finished: {participants}"
    # Killed at the end of its third step, group 1 printed steps 1 and 2; restarted, it heals to group 0's step. A heal
    # that fails (torchft reports the error, e.g. a checkpoint fetch timing out on a loaded machine) commits nothing
    # and prints the step it stands at, 1; the next quorum heals again.
    healed = next((index for index, (_, ok) in enumerate(restarted) if index >= 2 and ok), len(restarted))
    resumed = [step for step, _ in restarted[healed:]]
    assert restarted[:2] == [(1, True), (2, True)] and restarted[2:healed] == [(1, False)] * (healed - 2) \
        and resumed and resumed[0] > 3 and resumed == list(range(resumed[0], 61)), (restarted, job.stderr[-3000:])
    assert len(checksums(job.stdout)) == 2 and len(set(checksums(job.stdout).values())) == 1


def test_a_kill_during_the_cross_replica_all_reduce_commits_that_step_nowhere_and_corrupts_nothing():
    assert_a_kill_mid_exchange_commits_that_step_nowhere("cross-replica")


def assert_a_kill_mid_exchange_commits_that_step_nowhere(point: str, *options: str) -> None:
    """Group 1 dies in its third cross-group collective (``point``, see fault_injection/): group 0's step 3 fails and
    does not commit, its retry trains the same batch from the same state, and the groups end equal."""
    job = train(*GROUPS, *options, "--steps", "60", kill=f"0:{point}:3:1", step_sleep=STEP_SLEEP, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    survivor = steps(job.stdout, 0)
    failed = [index for index, (*_, ok) in enumerate(survivor) if not ok]
    assert [survivor[index][0] for index in failed] == [3], survivor[:6]
    # The retried step trains the same batch from the same parameters, so it prints the failed attempt's loss.
    retry = survivor[failed[0] + 1]
    assert retry[0] == 3 and retry[3] and retry[1] == survivor[failed[0]][1]
    assert [step for step, *_ in survivor][-1] == 60
    assert len(checksums(job.stdout)) == 2 and len(set(checksums(job.stdout).values())) == 1
