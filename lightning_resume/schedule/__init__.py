"""When to snapshot: the pure Young/Daly and two-level formulas (``formulas``), the validated options
(``config``), the pure state machine that decides each snapshot's tier (``state``), the run-time
scheduler (``scheduler``), the failure history (``history``), checkpoint health metrics (``metrics``)
and preemption signals (``preemption``). Nothing here imports Lightning."""
