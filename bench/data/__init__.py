"""The input pipeline's benchmark: cold and warm epochs against the stock loader."""
