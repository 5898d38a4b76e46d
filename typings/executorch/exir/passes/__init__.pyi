from typing import Any

# ops to_executorch keeps as they are (no out variant needed)
to_out_var_skiplist: list[Any]
