"""Training a small Beam on the Python standard library: the corpus and its split (`corpus`), the
tokenizer (`bpe`), the training loop (`loop`) and held-out evaluation (`evaluate`)."""
