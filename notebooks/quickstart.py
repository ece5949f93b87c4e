# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # flax-transformer quickstart: train, translate, look inside
#
# Trains a small Transformer (Vaswani et al., 2017) on Multi30k EN→DE, restores it from its Orbax
# checkpoint, translates with beam search, scores with sacreBLEU, and draws what the paper's figures show:
# the learning-rate schedule, the training curve, the positional encodings and attention heads.
# Everything comes from the `flax_transformer` package; this notebook defines no model code.

# %% tags=["parameters"]
# Parameters (the test sets FLAX_TRANSFORMER_NOTEBOOK_TINY=1 to run in a couple of minutes on a CPU).
import os

TINY = os.environ.get('FLAX_TRANSFORMER_NOTEBOOK_TINY', '0') == '1'
DATA_DIR = os.environ.get('MULTI30K_DIR', '../../shared/data/multi30k')  # local copy if present
WORKDIR = os.environ.get('NOTEBOOK_WORKDIR', '/tmp/flax_transformer_quickstart')
# Steps: 3,000 on a CPU runtime (about 35 minutes on 2 CPU cores, AMD EPYC, vocabulary and compilation included),
# the config's full 7,200 on a GPU or TPU runtime; 0 lets the next cells decide.
TRAIN_STEPS = 30 if TINY else 0

# %% [markdown]
# ## Get the code (Colab)
# **Set `REPO_URL` to the git URL of your copy of this repository** (your fork, or wherever you host it), or
# upload the repository folder to the runtime as `flax-transformer/`. Inside a checkout nothing is fetched.

# %%
REPO_URL = ''  # e.g. 'https://github.com/<you>/flax-transformer'

# %% [markdown]
# ## Install for this runtime and detect the backend
# The runtime's accelerator picks the extra: `[cuda12]` on a GPU runtime, `[tpu]` on a TPU runtime, the CPU
# set otherwise.

# %%
import shutil
import subprocess
import sys

ROOT = os.path.abspath('..') if os.path.isdir('../configs') else os.path.abspath('flax-transformer')
if not os.path.isdir(os.path.join(ROOT, 'configs')):
  if not REPO_URL:
    raise SystemExit('set REPO_URL in the cell above, or upload the repository as flax-transformer/')
  subprocess.run(['git', 'clone', '-q', REPO_URL, ROOT], check=True)
  extra = '[cuda12]' if shutil.which('nvidia-smi') else '[tpu]' if os.environ.get('COLAB_TPU_ADDR') or os.path.exists(
      '/dev/accel0') else ''
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '-e', ROOT + extra], check=True)
sys.path.insert(0, ROOT)

from flax_transformer import platforms, tensorflow_setup

tf = tensorflow_setup.import_quietly()  # tf.data only, kept off the accelerator
import jax
import matplotlib.pyplot as plt
import numpy as np

print(f'backend: {platforms.current()}, {jax.device_count()} device(s): {jax.devices()[0].device_kind}')

# %% [markdown]
# ## Data: Multi30k (from disk, or downloaded and checked against pinned checksums)

# %%
if not os.path.exists(os.path.join(DATA_DIR, 'train.en.gz')):
  DATA_DIR = os.path.join(WORKDIR, 'multi30k')
  subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'get_multi30k.py'), f'--dir={DATA_DIR}'], check=True)
print('Multi30k from', os.path.abspath(DATA_DIR))

# %% [markdown]
# ## Configure and build the mesh

# %%
from configs import multi30k
from flax_transformer import partitioning, settings

config = multi30k.get_config(data_dir=DATA_DIR)
config.num_train_steps = TRAIN_STEPS or (3000 if platforms.current() == 'cpu' else config.num_train_steps)
config.cooldown_steps = config.num_train_steps // 4  # the config ramps the rate to 0 over its last quarter
if TINY:  # a few-thousand-parameter model and few batch shapes, for a CPU test
  config.model.vocab_size, config.model.d_model, config.model.d_ff = 300, 32, 64
  config.model.num_encoder_layers = config.model.num_decoder_layers = 1
  config.train_source, config.train_target = config.eval_source, config.eval_target  # 1k pairs
  config.num_bucket_boundaries, config.max_train_length, config.max_eval_length = 1, 48, 64
  config.warmup_steps, config.checkpoint_every_steps, config.eval_every_steps = 10, 15, 30
  config.num_eval_bleu_sentences, config.keep_checkpoints, config.average_last = 0, 2, 2
  config.log_every_steps, config.tokens_per_batch = 5, 2048
run = settings.resolve(config)  # every field checked, and the 'auto' choices made for this platform, once
print(f'attention {run.model.attention}, dropout masks {run.model.dropout_masks}, beam top-k {run.decode.beam_top_k}')
mesh = partitioning.create_mesh(run.training.mesh_shape)
print('mesh:', dict(mesh.shape))

# %% [markdown]
# ## The learning-rate schedule (§5.3)

# %%
from flax_transformer import optim

steps = np.arange(1, 20001)
fig, ax = plt.subplots(figsize=(6, 3))
for d_model, warmup in ((512, 4000), (512, 8000), (256, 4000)):
  ax.plot(steps, optim.warmup_schedule(d_model, warmup)(steps), label=f'd_model={d_model}, warmup={warmup}')
ax.set_xlabel('step'); ax.set_ylabel('learning rate'); ax.legend(); ax.set_title('lrate = d^-0.5 · min(step^-0.5, step · warmup^-1.5)')
plt.show()

# %% [markdown]
# ## Sinusoidal positional encodings (§3.5)

# %%
from flax_transformer import layers

table = layers.sinusoidal_positions(100, 128)
fig, ax = plt.subplots(figsize=(7, 3))
image = ax.imshow(table.T, aspect='auto', cmap='RdBu')
ax.set_xlabel('position'); ax.set_ylabel('dimension'); fig.colorbar(image)
plt.show()

# %% [markdown]
# ## Train (checkpoints, vocabulary and TensorBoard logs land in WORKDIR; the banner says what it runs on)

# %%
from flax_transformer import metrics_log, train_loop

result = train_loop.train_and_evaluate(config, WORKDIR)
print(result['eval'])

# %% [markdown]
# ## The training curve

# %%
import json

records = [json.loads(line) for line in open(os.path.join(WORKDIR, metrics_log.METRICS_FILENAME))]
train = [(r['step'], r['loss']) for r in records if r['split'] == 'train']
evals = [(r['step'], r['loss']) for r in records if r['split'] == 'eval']
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(*zip(*train), label='train (label-smoothed)')
if evals:
  ax.plot(*zip(*evals), 'o-', label='validation')
ax.set_xlabel('step'); ax.set_ylabel('loss'); ax.legend()
plt.show()

# %% [markdown]
# ## Restore from the Orbax checkpoint (parameters only, averaged) and translate with beam search

# %%
from flax_transformer import Translator, parallel_text, scoring
from flax_transformer.constants import EOS_ID
from flax_transformer.model import Transformer

translator = Translator.from_workdir(WORKDIR)  # parameters only, the last config.average_last averaged
params, model_config, processor = translator.params, translator.model_config, translator.processor
sources = parallel_text.read_lines(config.test_source)[:8 if TINY else 200]
references = parallel_text.read_lines(config.test_target)[:len(sources)]
translations = translator.translate(sources)  # beam 4, α 0.6, max length = input + 50
for source, translation in list(zip(sources, translations))[:3]:
  print(f'{source}\n  -> {translation}')
score, signature = scoring.bleu(translations, references)
print(f'averaged checkpoints {list(translator.checkpoints)}; BLEU on {len(sources)} test_2016_flickr sentences: '
      f'{score:.2f} ({signature})')

# %% [markdown]
# ## Attention heads for one translated sentence
# The model sows every attention matrix into the `intermediates` collection when asked
# (`mutable=['intermediates']`); normal calls are unchanged.

# %%
source_ids = processor.encode(sources[0]) + [EOS_ID]
target_ids = (processor.encode(translations[0]) + [EOS_ID])[:model_config.max_positions]
model = Transformer(model_config)
_, state = model.apply({'params': params}, np.array([source_ids]), np.array([target_ids]),
                       mutable=['intermediates'])
inter = state['intermediates']
source_tokens = [processor.id_to_piece(i) for i in source_ids]
target_tokens = [processor.id_to_piece(i) for i in target_ids]
previous_tokens = ['<s>'] + target_tokens[:-1]


def draw_heads(weights, rows, columns, title):
  heads = weights.shape[1]
  fig, axes = plt.subplots(1, heads, figsize=(3.2 * heads, 3.2), squeeze=False)
  for h, ax in enumerate(axes[0]):
    ax.imshow(np.asarray(weights[0, h]), cmap='viridis', vmin=0, vmax=1)
    ax.set_xticks(range(len(columns))); ax.set_xticklabels(columns, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows))); ax.set_yticklabels(rows, fontsize=7)
    ax.set_title(f'head {h}')
  fig.suptitle(title)
  plt.show()


# Layers are scanned, so each sown tensor is stacked over layers: [layers, batch, heads, queries, keys].
layer = -1  # the last layer
draw_heads(inter['encoder']['self_attention']['attention_weights'][0][layer], source_tokens, source_tokens,
           'encoder self-attention, last layer')
draw_heads(inter['decoder']['cross_attention']['attention_weights'][0][layer], previous_tokens, source_tokens,
           'encoder-decoder attention, last layer')
