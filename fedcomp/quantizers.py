"""Compatibility: the quantizers live in `fedcomp.codecs`, one family a module; this module
re-exports the names code outside fedcomp imported from here."""

from fedcomp.codecs.blockwise import ANS_MODES, CODINGS  # noqa: F401
from fedcomp.codecs.fastpath import HALF_CODES, RunCodec, RunReply, runs, write_run  # noqa: F401
from fedcomp.codecs.fp import BFloat16, Float16, Identity  # noqa: F401
from fedcomp.codecs.kbit import KBit  # noqa: F401
from fedcomp.codecs.qsgd import QSGD  # noqa: F401
from fedcomp.codecs.sign import FixedSign, Sign, TwoBit  # noqa: F401
from fedcomp.codecs.terngrad import TernGrad  # noqa: F401
from fedcomp.codecs.values import Values, read_values, write_values  # noqa: F401
