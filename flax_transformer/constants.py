"""Reserved token ids and the numeric constants more than one module relies on."""

PAD_ID = 0  # Padding, and the decoder's start symbol.
EOS_ID = 1  # End of sentence.
UNK_ID = 2  # Pieces the vocabulary does not hold.

ATTENTION_MASK_VALUE = -1e9  # Added to masked attention logits; finite, so an all-masked row stays NaN-free.
IMPOSSIBLE_SCORE = -1e7  # Beam search's log-probability of a hypothesis that cannot be chosen (float32-safe sums).
