"""Multi30k EN→DE on the lowercased, tokenised `tok/` files the literature reports on (Wu et al., 2021: 41.0 BLEU)."""

from configs import multi30k


def get_config():
  config = multi30k.get_config(data_dir=multi30k.MULTI30K_DIR + '/tok', suffix='lc.norm.tok.{lang}.gz')
  config.bleu_tokenize = 'none'  # The references are already tokenized: tokenized, lowercased BLEU.
  # The recipe is multi30k.py's, chosen on `val` of both file sets.
  return config
