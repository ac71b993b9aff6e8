"""Prompt data: parquet files through pyarrow, a deterministic resumable cursor."""

from hyperrl.data.parquet import CursorState, DataError, PromptDataset, PromptLoader, Sample, data_source, render_chat

__all__ = ["PromptDataset", "PromptLoader", "CursorState", "Sample", "DataError", "render_chat", "data_source"]
