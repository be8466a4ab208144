"""The process and its machine: the host heap's policy and measured memory. The bottom layer: torch only."""
