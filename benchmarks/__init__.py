"""keras_dist benchmarks: each prints a table and returns ratios against plain tf.distribute.

Run them with `python benchmarks/run.py [--quick] [--only name,...]`; see `run.py`.
"""
