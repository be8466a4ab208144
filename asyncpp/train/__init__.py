"""The one trainer (segments, evaluation, checkpoints, preemption), metrics and the timeline."""
