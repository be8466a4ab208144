"""What both executors share: the update rule, the staleness corrections, the loss, partitioning and
router balancing."""
