"""Writes the clean (output-free) notebooks from the cell sources below.

Run `python notebooks/_make_notebooks.py` after editing a notebook's cells here; the
.ipynb files are what users open and what tests/test_notebooks.py executes.
"""

import pathlib

import nbformat

HERE = pathlib.Path(__file__).parent

QUICKSTART = [
    ("md", """# keras_dist quickstart: the seed example on virtual devices

This notebook trains the classic tf.distribute seed model (an MLP) on scikit-learn's digits
with keras_dist, on **2 virtual CPU devices** standing in for 2 GPUs. On a machine with GPUs,
skip `virtual_devices` and `keras_dist.strategy()` picks them up."""),
    ("code", """import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_dist

# Must run before TensorFlow initialises its runtime (first op or device listing).
devices = keras_dist.virtual_devices(2, "CPU")
devices"""),
    ("md", "## The factory picks the strategy\nOne worker with several devices -> `MirroredStrategy`."),
    ("code", """strategy = keras_dist.strategy()
print(type(strategy).__name__, "with", strategy.num_replicas_in_sync, "replicas")"""),
    ("md", "## Global batch scaling\nEach replica sees 32 examples per step; one step sees all of them."),
    ("code", """per_replica = 32
print("global batch:", keras_dist.global_batch_size(per_replica))
print("per-replica batch of 64:", keras_dist.per_replica_batch_size(64))
print("learning rate 0.05 scaled (linear):", keras_dist.scale_learning_rate(0.05))"""),
    ("code", """import numpy as np
from sklearn.datasets import load_digits

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
order = np.random.default_rng(0).permutation(len(x))
x_train, y_train = x[order[:1400]], y[order[:1400]]
x_test, y_test = x[order[1400:]], y[order[1400:]]
train_data = keras_dist.distribute_dataset((x_train, y_train), per_replica_batch_size=per_replica,
                                           repeat=True)
test_data = keras_dist.distribute_dataset((x_test, y_test), per_replica_batch_size=per_replica,
                                          shuffle=False)
print("steps per epoch:", keras_dist.steps_per_epoch(train_data))"""),
    ("code", """import keras

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(100, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(keras_dist.scale_learning_rate(0.05), momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
history = model.fit(train_data, epochs=6, steps_per_epoch=keras_dist.steps_per_epoch(train_data),
                    verbose=0,
                    callbacks=[keras_dist.callbacks.GradientAggregation(clipnorm=5.0)])
evaluation = model.evaluate(test_data, verbose=0, return_dict=True)
print({k: round(v, 4) for k, v in evaluation.items()})
assert history.history["loss"][-1] < history.history["loss"][0]"""),
    ("code", """import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
%matplotlib inline

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(history.history["loss"], marker="o", label="loss")
ax.plot(history.history["accuracy"], marker="s", label="accuracy")
ax.set_xlabel("epoch"); ax.set_title(f"{strategy.num_replicas_in_sync} replicas, digits MLP")
ax.legend(); plt.show()"""),
]

MULTI_WORKER = [
    ("md", """# Two workers from a notebook with `notebook_launcher`

`keras_dist.notebook_launcher(fn, num_workers=2)` starts 2 fresh worker processes with
`TF_CONFIG` on loopback ports, ships `fn` (defined here, in the notebook) to them, streams
their output here prefixed by worker, and returns each worker's return value. It works even
though this kernel may already have imported TensorFlow."""),
    ("code", """import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_dist"""),
    ("code", """def train(epochs):
    import hashlib
    import keras
    import numpy as np
    from sklearn.datasets import load_digits
    import keras_dist

    strategy = keras_dist.strategy()          # MultiWorkerMirroredStrategy: TF_CONFIG is set
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32"); y = digits.target.astype("int64")
    data = keras_dist.distribute_dataset((x, y), per_replica_batch_size=32, repeat=True)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(100, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(keras_dist.scale_learning_rate(0.05), momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(data, epochs=epochs, steps_per_epoch=keras_dist.steps_per_epoch(data),
                        verbose=0)
    if keras_dist.is_chief():
        print("chief finished", epochs, "epochs on", strategy.num_replicas_in_sync, "replicas")
    weights = b"".join(w.tobytes() for w in model.get_weights())
    return {"worker": keras_dist.worker_index(),
            "replicas": strategy.num_replicas_in_sync,
            "loss": history.history["loss"],
            "accuracy": history.history["accuracy"],
            "weights_sha256": hashlib.sha256(weights).hexdigest()}"""),
    ("code", """results = keras_dist.notebook_launcher(train, args=(4,), num_workers=2)
for r in results:
    print(r["worker"], r["replicas"], r["weights_sha256"][:16],
          [round(v, 4) for v in r["loss"]])"""),
    ("md", "Both workers end with **identical weights** (same hash) and report the same, global loss."),
    ("code", """assert len(results) == 2 and results[0]["replicas"] == 2
assert results[0]["weights_sha256"] == results[1]["weights_sha256"]
assert results[0]["loss"] == results[1]["loss"]
assert results[0]["loss"][-1] < results[0]["loss"][0]
print("final accuracy:", round(results[0]["accuracy"][-1], 4))"""),
]

AGGREGATION = [
    ("md", """# Gradient aggregation that equals single-device training

Under plain tf.distribute, stock Keras clips each replica's *local* gradient before the
all-reduce, and its `gradient_accumulation_steps` crashes (keras#20582); under
`keras_dist.strategy()` both options act as on one device. On top of that,
`keras_dist.callbacks.GradientAggregation` all-reduces first and then clips, accumulates
locally and all-reduces once per k steps, and can compress gradients to bf16/fp16 on the wire.
Each feature below is compared with single-device training on the same global batch."""),
    ("code", """import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_dist
devices = keras_dist.virtual_devices(2, "CPU")"""),
    ("code", """import keras
import numpy as np
import tensorflow as tf

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 20)).astype("float32")
y = (x @ rng.normal(size=(20, 4))).astype("float32") * 3.0
init = None

def make_model(**optimizer_kwargs):
    global init
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(4)])
    if init is None:
        init = model.get_weights()
    model.set_weights(init)
    model.compile(optimizer=keras.optimizers.SGD(0.05, **optimizer_kwargs), loss="mse")
    return model

def train(strategy, batch, callbacks=(), epochs=2, **optimizer_kwargs):
    with strategy.scope():
        model = make_model(**optimizer_kwargs)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    history = model.fit(data, epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks))
    return model.get_weights(), history.history["loss"]

def max_diff(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))

two = keras_dist.strategy(devices=devices)
one = tf.distribute.OneDeviceStrategy("/cpu:0")
print(two.num_replicas_in_sync, "replicas vs 1 device")"""),
    ("code", """rows = []
GA = keras_dist.callbacks.GradientAggregation

w1, l1 = train(one, 32, global_clipnorm=1.0)
w2, l2 = train(two, 32, [GA(clipnorm=1.0)])
rows.append(("clipnorm=1.0 after all-reduce", max_diff(w1, w2), l1, l2))
w_stock, _ = train(two, 32, global_clipnorm=1.0)
rows.append(("stock Keras global_clipnorm, no callback", max_diff(w1, w_stock), None, None))

w1, l1 = train(one, 128)
w2, l2 = train(two, 32, [GA(accumulation_steps=4)])
rows.append(("accumulation_steps=4, batch 32 vs 128", max_diff(w1, w2), l1, l2))

w1, l1 = train(one, 32)
w2, l2 = train(two, 32, [GA(compression="bf16")])
rows.append(("bf16 compression", max_diff(w1, w2), l1, l2))
w3, l3 = train(two, 32, [GA(compression="fp16")])
rows.append(("fp16 compression", max_diff(w1, w3), l1, l3))

print(f"{'feature':45s} max |w - w_single|")
for name, diff, _, _ in rows:
    print(f"{name:45s} {diff:.2e}")"""),
    ("code", """assert rows[0][1] < 1e-5, rows[0]          # clipping after aggregation == single device
assert rows[1][1] < 1e-5, rows[1]          # stock option, fixed by keras_dist.strategy()
assert rows[2][1] < 1e-5, rows[2]          # accumulation == large batch
assert rows[3][1] < 1e-2 and rows[4][1] < 1e-2"""),
    ("code", """import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
%matplotlib inline

fig, ax = plt.subplots(figsize=(7, 3.5))
names = [r[0] for r in rows]
ax.barh(names, [max(r[1], 1e-9) for r in rows])
ax.set_xscale("log"); ax.set_xlabel("max |w - w_single_device| after 2 epochs")
ax.axvline(1e-5, color="k", ls="--", lw=1)
plt.tight_layout(); plt.show()"""),
]


MODEL_PARALLEL = [
    ("md", """# Model parallelism: a pipeline across devices, and sharded layers

When a model's parameters and optimizer slots do not fit one device, `keras_dist.parallel`
splits it: `split_sequential` cuts a `keras.Sequential` into stages, `PipelineModel` puts
stage s on device s and trains with a GPipe schedule (micro-batches, one optimizer apply),
and `ShardedDense` / `ShardedEmbedding` split one kernel across devices. Here **2 virtual CPU
devices** stand in for 2 GPUs."""),
    ("code", """import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_dist

devices = keras_dist.virtual_devices(2, "CPU")
devices"""),
    ("code", """import keras
import numpy as np
from keras_dist.parallel import PipelineModel, ShardedDense, split_sequential

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 16)).astype("float32")
y = (x @ rng.normal(size=(16, 2))).astype("float32")

def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,))] + [
        keras.layers.Dense(32, activation="tanh") for _ in range(3)] + [keras.layers.Dense(2)])

single = make_model()
single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
h1 = single.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)"""),
    ("md", "## Two stages, four micro-batches, recomputed activations"),
    ("code", """stages = split_sequential(make_model(), 2)
pipe = PipelineModel(stages, num_microbatches=4, remat=True)
pipe.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
h2 = pipe.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
for stage, device in zip(pipe.stages, pipe.devices):
    print(stage.name, "on", device, {v.value.device.split("device:")[-1] for v in stage.variables})
diff = max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), pipe.get_weights()))
print("max |w_pipeline - w_single_device| =", diff)
print("losses:", h1.history["loss"], h2.history["loss"])
assert diff < 1e-5"""),
    ("md", "## A Dense layer split by columns across the two devices"),
    ("code", """sharded = ShardedDense(8, mode="column", activation="relu")
dense = keras.layers.Dense(8, activation="relu")
out_sharded = sharded(x)
dense.build(x.shape)
dense.set_weights(sharded.get_weights())   # the unsharded Dense layout
print({v.value.device.split("device:")[-1] for v in sharded.variables})
assert np.allclose(out_sharded, dense(x), atol=1e-6)"""),
]


KERAS_DISTRIBUTION = [
    ("md", """# Keras's own `keras.distribution` on TensorFlow: a tiny Llama on a (2, 2) mesh

`keras.distribution` (DeviceMesh, LayoutMap, DataParallel, ModelParallel) is the API the
keras-io guide "Distributed training with Keras 3" teaches; keras-hub ships layouts for its
LLMs. Keras runs it on JAX only; after `import keras_dist` the same code runs on TensorFlow
(on DTensor). Here **4 virtual CPU devices** stand in for 4 GPUs: a (2, 2) mesh with a
`batch` axis (data parallel) and a `model` axis (tensor parallel)."""),
    ("code", """import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"
import keras_dist

keras_dist.virtual_devices(4, "CPU")   # before TensorFlow starts; skip on a GPU machine
import keras
import keras_hub
import numpy as np
from keras import distribution as kd

devices = kd.list_devices()
devices"""),
    ("md", "## A tiny Llama (random weights, no download) and a language-model head"),
    ("code", """def build():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, dtype="float32")
    inputs = {"token_ids": keras.Input((8,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((8,), dtype="int32", name="padding_mask")}
    logits = keras.layers.Dense(64, name="lm_head")(backbone(inputs))
    model = keras.Model(inputs, logits)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, backbone

rng = np.random.default_rng(0)
x = {"token_ids": rng.integers(0, 64, (16, 8)).astype("int32"),
     "padding_mask": np.ones((16, 8), "int32")}
y = rng.integers(0, 64, (16, 8)).astype("int32")

single, _ = build()   # the reference: one device
single.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)"""),
    ("md", """## keras-hub's own layout on the mesh
`LlamaBackbone.get_layout_map(mesh)` says which axis of each weight goes to which mesh axis;
`ModelParallel` splits the batch along `batch`. The model is created, compiled and trained
exactly as on one device."""),
    ("code", """mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices)
kd.set_distribution(kd.ModelParallel(
    layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh), batch_dim_name="batch"))
model, backbone = build()
history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), single.get_weights()))
print("losses:", history.history["loss"])
print("max |w_mesh - w_one_device| =", diff)
assert diff < 1e-5"""),
    ("md", """## What each device stores
`keras_dist.parallel.shards(variable)` lists `(device, value)` per device (JAX's
`addressable_shards`). The token embedding (64 x 16) is split on both mesh axes: each device
keeps a (32, 8) quarter."""),
    ("code", """embedding = backbone.token_embedding.embeddings
for device, value in keras_dist.parallel.shards(embedding):
    print(device.split("/")[-1], value.shape)

def bytes_on(device_index, variables):
    return sum(keras_dist.parallel.shards(v)[device_index][1].nbytes for v in variables)

full = sum(v.numpy().nbytes for v in model.weights)
per_device = [bytes_on(i, model.weights) for i in range(4)]
print(f"all weights: {full} bytes; stored per device: {per_device} "
      f"({per_device[0] / full:.2f} of a full copy)")"""),
    ("md", """Saving writes the full values: a checkpoint written on the mesh loads on one device
and the reverse (`model.save_weights(...)`, `keras.saving.load_model(...)` as usual)."""),
]

FINE_TUNING = [
    ("md", """# Fine-tune a large model on TensorFlow: LoRA, then `generate()`, on a mesh

Google's "Distributed tuning with Gemma using Keras" at toy size: a keras-hub Gemma
(random weights, no download) sharded with keras-hub's own layout map, fine-tuned with LoRA
and sampled with `generate()`, on **4 virtual CPU devices** standing in for 4 GPUs. Then the
same with `keras_dist.distribution.FSDP`, which needs no layout map, and what each device
stores. Every result is compared with one device."""),
    ("code", """import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"
import keras_dist

keras_dist.virtual_devices(4, "CPU")   # before TensorFlow starts; skip on a GPU machine
import keras
import keras_hub
import numpy as np
from keras import distribution as kd

devices = kd.list_devices()
devices"""),
    ("md", """## Data: a few sentences, a word-level vocabulary
(The tutorial uses Gemma's tokenizer and a preset; here the ids come from a tiny vocabulary
so that nothing is downloaded.)"""),
    ("code", """sentences = ["the cat sat on the mat", "the dog sat on the log",
             "a cat saw a dog", "the dog saw the cat on the mat"] * 4
words = sorted({w for s in sentences for w in s.split()})
vocab = ["<pad>", "<bos>"] + words
# Padded to a multiple of 8, as real vocabularies are: keras-hub's layout map splits the
# embedding's rows over the "model" axis.
vocab += [f"<unused{i}>" for i in range(-len(vocab) % 8)]
ids = {w: i for i, w in enumerate(vocab)}
length = 10

def encode(text):
    tokens = [ids["<bos>"]] + [ids[w] for w in text.split()]
    return tokens + [0] * (length + 1 - len(tokens))

tokens = np.array([encode(s) for s in sentences], "int32")
x = {"token_ids": tokens[:, :-1], "padding_mask": (tokens[:, :-1] > 0).astype("int32")}
y = tokens[:, 1:]
sample_weight = (y > 0).astype("float32")

prompt_words = ["<bos>", "the", "cat"]
prompt = {"token_ids": np.zeros((4, length), "int32"), "padding_mask": np.zeros((4, length), "int32")}
prompt["token_ids"][:, :3] = [ids[w] for w in prompt_words]
prompt["padding_mask"][:, :3] = 1
print(len(vocab), "words;", tokens.shape[0], "sentences")"""),
    ("md", """## The model: Gemma, LoRA on its attention, Adam
`enable_lora(8)` freezes every backbone weight and adds rank-8 adapters to the query and value
projections: only those train."""),
    ("code", """def build():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=len(vocab), num_layers=1, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=32, intermediate_dim=64, head_dim=8)
    backbone.enable_lora(8)
    causal_lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    causal_lm.compile(optimizer=keras.optimizers.Adam(5e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=[], sampler="greedy")
    return causal_lm

def tune_and_generate(causal_lm):
    history = causal_lm.fit(x, y, sample_weight=sample_weight, batch_size=8, epochs=30,
                            shuffle=False, verbose=0)
    out = causal_lm.generate(prompt, stop_token_ids=None)
    return history.history["loss"], np.asarray(out["token_ids"])

def words_of(token_ids):
    return " ".join(vocab[i] for i in token_ids if i > 1)


one_device = build()
print("trainable:", [v.path for v in one_device.trainable_weights])
reference_loss, reference_tokens = tune_and_generate(one_device)
print("loss", [round(l, 3) for l in reference_loss[::5]])
print("one device:", words_of(reference_tokens[0]))"""),
    ("md", """## The same on a (1, 4) mesh, with keras-hub's layout map
The model is created under the distribution; `fit` and `generate()` are the same calls.
The KV cache of `generate()` lives on the mesh too."""),
    ("code", """mesh = kd.DeviceMesh((1, 4), ["batch", "model"], devices)
model_parallel = kd.ModelParallel(
    layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch")
with model_parallel.scope():
    sharded = build()
loss, generated = tune_and_generate(sharded)
print("mesh:      ", words_of(generated[0]))
print("same tokens as one device:", np.array_equal(generated, reference_tokens))
print("max loss difference:", float(np.abs(np.subtract(loss, reference_loss)).max()))
assert np.array_equal(generated, reference_tokens)"""),
    ("md", """## Any model, no layout map: FSDP
`keras_dist.distribution.FSDP` splits the batch over the devices and every variable of at
least `min_elements` elements on its largest divisible dimension (optimizer slots follow)."""),
    ("code", """with keras_dist.distribution.FSDP(min_elements=1024).scope():
    fsdp = build()
loss, generated = tune_and_generate(fsdp)
print("FSDP:      ", words_of(generated[0]))
assert np.array_equal(generated, reference_tokens)"""),
    ("md", """## What each device stores
Bytes of the model's variables (params) and of Adam's (slots) on device 0, for one device
(and `DataParallel`, a full copy per device), `ModelParallel` (1, 4) and FSDP. LoRA's adapters and
their slots are small and replicated; the frozen weights are what sharding saves."""),
    ("code", """def bytes_per_device(model):
    def held(variables):
        return sum(keras_dist.parallel.shards(v)[0][1].nbytes for v in variables)
    return held(model.weights), held(model.optimizer.variables)

# DataParallel keeps a full copy on each device: one device's bytes.
rows = {"one device / DataParallel(4)": bytes_per_device(one_device),
        "ModelParallel (1, 4)": bytes_per_device(sharded), "FSDP (4)": bytes_per_device(fsdp)}
for name, (params, slots) in rows.items():
    print(f"{name:30s} params {params / 1024:7.1f} KiB  slots {slots / 1024:6.1f} KiB")"""),
    ("code", """import matplotlib.pyplot as plt

names = list(rows)
params = [rows[n][0] / 1024 for n in names]
slots = [rows[n][1] / 1024 for n in names]
fig, ax = plt.subplots(figsize=(8, 2.5))
ax.barh(names, params, label="params")
ax.barh(names, slots, left=params, label="optimizer slots")
ax.set_xlabel("KiB on device 0")
ax.invert_yaxis()
ax.legend()
plt.tight_layout()"""),
]


def _write(name, cells):
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    for kind, source in cells:
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        notebook.cells.append(make(source))
    nbformat.write(notebook, HERE / name)


if __name__ == "__main__":
    _write("01_quickstart.ipynb", QUICKSTART)
    _write("02_multi_worker.ipynb", MULTI_WORKER)
    _write("03_gradient_aggregation.ipynb", AGGREGATION)
    _write("04_model_parallel.ipynb", MODEL_PARALLEL)
    _write("05_keras_distribution.ipynb", KERAS_DISTRIBUTION)
    _write("06_fine_tune_large_model.ipynb", FINE_TUNING)
