"""Old import path; the Slurm parser lives in `keras_dist.cluster.slurm`."""

from keras_dist.cluster.slurm import *  # noqa: F401,F403
from keras_dist.cluster.slurm import expand_hostlist, expand_tasks_per_node, tf_config_from_slurm  # noqa: F401
