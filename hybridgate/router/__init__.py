"""The embeddable Router: tokenize, detokenize, stop strings, placement, registry, response cache."""
