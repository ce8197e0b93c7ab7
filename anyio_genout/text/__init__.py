"""The text layer: tokenizer, incremental detokenizer and stop strings above the generate layer.

(Facade in progress: the modules of this package are being built for issue 14.)
"""
