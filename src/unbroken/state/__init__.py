"""Train state that is not a tensor: RNG streams, and how state values are captured."""
