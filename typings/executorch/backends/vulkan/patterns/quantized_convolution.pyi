import torch
from torch.export import ExportedProgram

class QuantizedConvolutionMatch:
    def __init__(self, conv_node: torch.fx.Node) -> None: ...

def find_quantized_convolution_patterns(node: torch.fx.Node) -> QuantizedConvolutionMatch | None: ...
def make_q8ta_conv2d_custom_op(
    ep: ExportedProgram, graph_module: torch.fx.GraphModule, match: QuantizedConvolutionMatch
) -> None: ...
