"""O2's op policy (:mod:`.policy`): compiled kernels over torch's autocast kernels that keep norms, softmax
and elementwise math in half inside O2's forward (docs/o2-design.md)."""
