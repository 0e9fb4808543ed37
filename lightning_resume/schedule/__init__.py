"""When to snapshot: the pure Young/Daly policy and state machine (``policy``), the run-time scheduler
(``scheduler``), the failure history (``history``), checkpoint health metrics (``metrics``) and
preemption signals (``preemption``). Nothing here imports Lightning."""
