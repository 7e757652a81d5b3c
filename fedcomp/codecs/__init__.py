"""The built-in codecs, one family a module; importing this package registers them.

Quantizers (values -> bytes): `fp` (none, fp16, bf16), `sign` (sign, twobit), `kbit`, `qsgd`,
`terngrad`. Reducers (a segment -> fewer values): `sparsify` (topk, threshold, randomk), `dgc`,
`powersgd`, `sketch`. Shared machinery: `blockwise` (chunked blockwise encoding), `values` (lazy decoded
values for the server), `fastpath` (the `RunCodec` protocol: every segment in one compiled call).
"""

# in registration order (the registry's order is the order specs and tables list them in)
from fedcomp.codecs import fp  # noqa: F401, I001
from fedcomp.codecs import sign  # noqa: F401
from fedcomp.codecs import kbit  # noqa: F401
from fedcomp.codecs import qsgd  # noqa: F401
from fedcomp.codecs import terngrad  # noqa: F401
from fedcomp.codecs import sparsify  # noqa: F401
from fedcomp.codecs import dgc  # noqa: F401
from fedcomp.codecs import powersgd  # noqa: F401
from fedcomp.codecs import sketch  # noqa: F401
