"""Old import path of `keras_dist.strategies` (kept working).

`keras_dist.strategy` is the factory function: `keras_dist/__init__.py` loads this module
first and then binds the name to the function, so `import keras_dist.strategy` and
`from keras_dist.strategy import resolve_strategy` keep working while
`keras_dist.strategy()` still builds the strategy.
"""

from keras_dist.strategies import (  # noqa: F401
    _info_lines,
    communication_options,
    resolve_strategy,
    strategy,
)

__all__ = ["strategy", "resolve_strategy"]
