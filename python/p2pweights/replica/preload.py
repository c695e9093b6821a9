"""Imported by a multiprocessing forkserver: sglang once, before any child is forked from it.

Forking from a process that already ran parallel torch ops can deadlock the child (OpenMP's pool
does not survive fork), so senders fork from this clean server instead of from the coordinator.
"""
from .sglang_env import prepare

prepare()
