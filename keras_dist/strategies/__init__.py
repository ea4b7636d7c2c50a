"""Strategies: the factory behind `keras_dist.strategy()` and what it is built from.

Modules: `factory` (`strategy()`, `resolve_strategy()`: which strategy, built once per
process), `args` (the factory's argument checks and messages), `one_device` (the
one-replica strategies with a cluster resolver), `communication` (the collective
options: implementation, bytes per pack, timeout; one object shared with the aggregation).
"""

from keras_dist.strategies.factory import resolve_strategy, strategy

__all__ = ["resolve_strategy", "strategy"]
