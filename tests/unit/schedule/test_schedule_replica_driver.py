"""The hook side of the three-level schedule: the scheduler's agreed "replicate" goes to
``MemoryTier.save(..., replicate=)``, each replica transfer's time (``Replicator.last_transfer``) is recorded
once as D2, and a tier that stopped replicating turns the schedule back to two levels."""

from types import SimpleNamespace

from lightning_resume.exact import driver
from lightning_resume.memory.replicate import TransferStats
from lightning_resume.memory.tier import REPLICA
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.scheduler import SnapshotScheduler
from lightning_resume.schedule.state import Tier


class FakeTier:
    """What ``driver.memory_snapshot`` uses of a ``MemoryTier`` with replicas."""

    def __init__(self) -> None:
        self.replicas = 1
        self.replicator = SimpleNamespace(enabled=True, last_transfer=None)
        self.borrowed_bytes = 0
        self.calls: list = []

    def save(self, trainer, borrow=None, replicate=None):  # None: the caller said nothing
        self.calls.append(replicate)
        return 1000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_replicate_decision_reaches_the_tier_and_transfer_times_are_recorded_once():
    assert REPLICA == Tier.REPLICA.value  # the resume source the history reads
    clock = Clock()
    # node losses as common as process losses (M2 = M1 = 1 h per node): replicas pay
    cfg = ScheduleConfig(mtbf_s=3600.0, process_mtbf_s=3600.0, min_interval_s=1.0, num_nodes=2, replicas=None)
    sched = SnapshotScheduler(cfg, clock)
    tier = FakeTier()
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, loggers=[])
    sched.start(0, 2, {"costs": [20.0], "memory_costs": [0.5]}, None, replicas=tier.replicas)
    assert sched.state is not None and sched.state.config.replicates
    agreed = []
    for step in range(1, 200):
        clock.now += 1.0
        trainer.global_step = step
        decided, _, _ = sched.decide(step, 0, lambda values: values, True)
        if decided is Tier.MEMORY:
            agreed.append(sched.replicate)
            driver.memory_snapshot(sched, trainer, tier)
            tier.replicator.last_transfer = TransferStats(1000, 2.0 + step / 100, step, len(tier.calls))
    assert tier.calls == agreed and all(agreed)  # the plan replicates every snapshot here
    assert sched.memory is not None and len(sched.memory.replica_costs) == min(5, len(tier.calls) - 1)
    recorded = sched.memory.replica_costs
    driver.replica_measured(sched, tier)
    driver.replica_measured(sched, tier)  # the same transfer again: recorded once
    assert sched.memory.replica_costs == (recorded + (tier.replicator.last_transfer.seconds,))[-5:]


def test_a_tier_that_stopped_replicating_turns_the_schedule_to_two_levels():
    cfg = ScheduleConfig(mtbf_s=30 * 86400.0, process_mtbf_s=3600.0, min_interval_s=1.0, num_nodes=2, replicas=None)
    sched = SnapshotScheduler(cfg, Clock())
    sched.start(0, 2, {"costs": [20.0], "memory_costs": [0.5]}, None, replicas=1)
    tier = FakeTier()
    tier.replicator.enabled = False  # a replica did not fit the peer's tmpfs: the tier warned and stopped
    driver.replica_measured(sched, tier)
    assert sched.state is not None and not sched.state.config.replicates
    # the memory tier's resolved count replaces the option's: 0 replicas on 2 nodes is two levels from the start
    other = SnapshotScheduler(cfg, Clock())
    other.start(0, 2, None, None, replicas=0)
    assert other.state is not None and not other.state.config.replicates
