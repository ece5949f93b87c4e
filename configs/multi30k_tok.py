"""Multi30k EN→DE on the lowercased, tokenised `tok/` files the literature reports on (Wu et al., 2021: 41.0 BLEU).

The recipe is configs/multi30k.py's; a data directory passes through: --config=configs/multi30k_tok.py:DIR/tok
"""

from configs import multi30k


def get_config(data_dir: str | None = None):  # the tok/ files are not downloaded: give their folder elsewhere
  config = multi30k.get_config(data_dir=data_dir or multi30k.MULTI30K_DIR + '/tok', suffix='lc.norm.tok.{lang}.gz')
  config.bleu_tokenize = 'none'  # The references are already tokenized: tokenized, lowercased BLEU.
  return config
