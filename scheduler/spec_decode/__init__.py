"""Speculative decoding, scheduler side: draft proposers and their back-off.

The worker verifies what is proposed here (worker/rejection_sampler.py); the
scheduler budgets the drafts and rolls back the rejected ones
(scheduler/scheduler.py).
"""
