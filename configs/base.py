"""Transformer (base) on WMT14 EN→DE: Table 3 row "base" of Vaswani et al. (2017)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # --- Architecture (§3, Table 3 base) ---
  config.model = ml_collections.ConfigDict()
  config.model.vocab_size = 37000  # §5.1: shared source-target BPE vocabulary of about 37k.
  config.model.d_model = 512
  config.model.num_heads = 8
  config.model.d_ff = 2048
  config.model.num_encoder_layers = 6  # N = 6.
  config.model.num_decoder_layers = 6
  config.model.dropout_rate = 0.1  # §5.4 P_drop.
  config.model.attention_dropout_rate = 0.0  # The paper uses none.
  config.model.dropout_masks = 'auto'  # 'hash' (fused index hash, faster on CPU), 'random' (jax.random); auto: hash on CPU only.
  config.model.attention = 'auto'  # jax.nn.dot_product_attention: 'cudnn' on GPU in bf16, else 'xla'; 'explicit' writes it out.
  config.model.pre_norm = False  # Post-LN, as in §3.1.
  config.model.learned_positions = False  # Sinusoids (§3.5); Table 3 row E shows they tie.
  config.model.share_embeddings = True  # §3.4.
  config.model.max_positions = 512  # Position-table rows: longest sentence (or decode) in tokens.
  config.model.dtype = 'float32'  # 'bfloat16' computes in bf16 with float32 parameters.
  config.model.layer_norm_epsilon = 1e-6
  config.model.scan_unroll = 1  # Layers per scan step; all layers unrolled: faster CPU steps, longer compiles.

  # --- Data (§5.1) ---
  config.dataset = 'wmt14_translate/de-en'  # A tfds name, or 'files' for the *_source/*_target paths below.
  config.source_lang = 'en'  # EN→DE, the paper's first task; swap for DE→EN.
  config.target_lang = 'de'
  config.data_dir = ''  # tfds data directory; '' means $TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.train_split = 'train'
  config.eval_split = 'validation'  # newstest2013, the paper's development set.
  config.test_split = 'test'  # newstest2014, the paper's test set.
  config.train_source = ''  # Plain or .gz text files, one sentence a line (dataset='files').
  config.train_target = ''
  config.eval_source = ''
  config.eval_target = ''
  config.test_source = ''
  config.test_target = ''
  config.download_url = ''  # Where missing data files are fetched from ({name}: the file's name); '': nowhere.
  config.vocab_path = ''  # An existing SentencePiece model; '' trains one into the workdir.
  config.init_from = ''  # 'WORKDIR[:STEP]': fine-tune, starting from that run's parameters and vocabulary.
  config.vocab_type = 'bpe'  # §5.1 byte-pair encoding; 'unigram' is the alternative.
  config.vocab_sample_sentences = 4_000_000  # Drawn uniformly from both sides of the whole split (SentencePiece's memory grows with it).
  config.max_train_length = 256  # Training pairs with a longer side (in tokens) are dropped and counted.
  config.token_cache = ''  # The training split tokenised once (folder or gs:// URL, shareable); '': WORKDIR/token_cache.
  config.token_cache_block_pairs = 131_072  # Pairs per cache block: the unit of its parallel, resumable build.
  config.max_eval_length = 256  # Longest eval sentence kept whole; longer ones are truncated and counted.
  config.tokens_per_batch = 25_000  # §5.1: about 25,000 source and 25,000 target tokens per batch (global: all processes and devices).
  config.eval_tokens_per_batch = 8192  # Per-batch token budget for evaluation and decoding.
  config.num_bucket_boundaries = 16  # Length buckets: a bounded number of compiled shapes.
  config.bucket_shapes = 'pairs'  # 3 shapes per bucket, each side padded to its own; 'longer_side': 1 shape.

  # --- Optimisation (§5.3, §5.4) ---
  config.label_smoothing = 0.1
  config.warmup_steps = 4000
  config.learning_rate_factor = 1.0  # Multiplies the paper's schedule (1.0 = exactly the paper).
  config.lr_decay = 'inverse_sqrt'  # The paper's; 'constant' holds the warmup's peak (not in the paper).
  config.cooldown_steps = 0  # > 0: the rate ramps linearly to 0 over the last this-many steps (not in the paper).
  config.adam_b1 = 0.9
  config.adam_b2 = 0.98
  config.adam_eps = 1e-9
  config.grad_clip_norm = 0.0  # 0 disables clipping (the paper does not clip).
  config.num_train_steps = 100_000  # §5.2: 100k steps for base.
  config.gradient_accumulation_steps = 1  # Reach 25k-token batches on fewer devices.
  config.ema_decay = 0.0  # > 0: an exponential moving average of the weights (e.g. 0.999; not in the paper).
  config.max_skipped_steps = 5  # Consecutive steps with non-finite gradients skipped (optax.apply_if_finite) before the run stops.
  config.loss_spike_factor = 3.0  # Stop when the loss stays above this many times its running median ... (0: never).
  config.loss_spike_steps = 20  # ... for this many consecutive steps.
  config.seed = 0
  config.restore_data_state = True  # False: a resumed run restarts the data stream (e.g. after changing the process count).
  config.dropout_rng_impl = 'rbg'  # Key generator for dropout seeds (and for every mask when model.dropout_masks='random').
  config.output_loss = 'auto'  # 'fused': hand-written projection + loss gradient (faster on CPU); 'optax': autodiff.

  # --- Checkpoints, evaluation, logging ---
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 10  # §6.1 averages the last 5 (base) checkpoints; keep at least that.
  config.keep_best = 0  # > 0: also keep this many best checkpoints by config.best_metric (not in the paper).
  config.best_metric = 'bleu'  # What keep_best and early stopping judge: validation 'bleu' (higher) or 'loss' (lower).
  config.early_stopping_evaluations = 0  # > 0: end the run after this many evaluations without improvement.
  config.eval_every_steps = 1000
  config.log_every_steps = 100
  config.bleu_tokenize = '13a'  # sacreBLEU tokenizer for eval and translate.py --reference ('none': pre-tokenized).
  config.num_eval_bleu_sentences = 256  # Validation sentences translated for BLEU at each eval (0: none).
  config.storage_timeout_seconds = 300  # A checkpoint save or metrics write still unfinished after this stops the run.

  # --- Decoding (§6.1) ---
  config.strategy = 'beam'  # 'beam' (§6.1), 'greedy', or 'sampling' (with the four settings below).
  config.beam_size = 4
  config.length_penalty_alpha = 0.6
  config.max_extra_length = 50  # Maximum output length = input length + 50.
  config.beam_stop = 'bound'  # A sentence's beam stops once no live hypothesis can beat its best ended one.
  config.temperature = 1.0  # sampling: logits / temperature; then the k most probable (0: all), then the
  config.top_k = 0  # most probable whose probabilities add up to top_p (1.0: all).
  config.top_p = 1.0
  config.num_samples = 1  # sampling: translations drawn per sentence.
  config.sampling_seed = 0  # sampling: a sentence's samples depend only on this, its number and theirs.
  config.constraint_order = 'unordered'  # translate.py --constraints_file: phrases anywhere, or 'ordered' as given.
  config.decode_slots = 128  # Sentences decoded at once by the engine, each refilled as it finishes.
  config.average_last = 5  # Checkpoints averaged for the final model (base: 5).
  config.beam_top_k = 'auto'  # 'two_stage' (block maxima first, faster on CPU) or 'lax' (jax.lax.top_k); auto: by platform.

  # --- Devices ---
  config.platform = ''  # '' runs on whatever JAX finds; 'gpu' or 'tpu' refuses to start anywhere else.
  config.mesh_shape = (-1, 1, 1)  # (data, fsdp, model); -1 takes the remaining devices.
  # Multi-process runs: TPU VMs, GKE, SLURM and Open MPI are detected from the environment; elsewhere set all three.
  config.coordinator_address = ''  # host:port of process 0, e.g. '10.0.0.1:1234'.
  config.num_processes = 1
  config.process_id = 0
  config.initialization_timeout_seconds = 300  # how long the processes have to start and find each other.
  config.heartbeat_timeout_seconds = 30  # a process silent this long is dead: every other one stops, naming it.
  config.shutdown_timeout_seconds = 60  # how long an exiting process waits for the others at the end.
  return config
