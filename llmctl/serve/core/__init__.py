"""Scheduling state: sequences, the block manager, ordering policies, admission, the scheduler."""
