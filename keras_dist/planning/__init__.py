"""Planning: how will data-parallel training scale on a real network?

* `predict(params, step_ms, link_rate=..., workers=...)`: an alpha-beta model of the
  ring all-reduce combined with measured compute (`keras-dist plan` prints it);
* `fit_alpha_beta(samples)`: the model's parameters from all-reduce timings;
* `run_in_link(fn, Link(...))`: the link simulator, local workers behind a rate-limited
  loopback in a private network namespace (`keras-dist bench allreduce --link-rate`).
"""

from keras_dist.planning.link import (Link, LinkSimulatorError, check_support, measure_link,
                                      run_in_link)
from keras_dist.planning.model import (DEFAULT_LINK_RATES, DEFAULT_WORKERS, Engine,
                                       Prediction, allreduce_time, fit_alpha_beta,
                                       format_rate, load_engine, parse_duration, parse_rate,
                                       predict, table_lines)

__all__ = [
    "DEFAULT_LINK_RATES", "DEFAULT_WORKERS", "Engine", "Link", "LinkSimulatorError",
    "Prediction", "allreduce_time", "check_support", "fit_alpha_beta", "format_rate",
    "load_engine", "measure_link", "parse_duration", "parse_rate", "predict", "run_in_link",
    "table_lines",
]
