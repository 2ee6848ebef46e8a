"""Training the ILCP encoder and the two tuned baselines with PyTorch Lightning.

    python train.py                                   # embedded SmolLM2, bAbI task 1
    python train.py --config configs/tiny.yaml        # seconds, tiny random LM (tests)

Where things are:
- `extraction`: the sender's states of a task's contexts (a Lightning predict loop, cached on disk);
- `data`: task rows with the sender's (cached) states, batches, the data module;
- `compressor_stage`: stage 1, the beta-VAE (and attention pooler) with the optional answer head;
- `reconstruction_stage`: optional, the encoder trained to make the LM say each context back;
- `handoff_stage`: stage 2, any memory source trained on answers through the frozen LM;
- `pipeline`: `train(cfg)`, which runs them in order and exports the run;
- `log`: progress lines, the shared Trainer settings, validation curves.

The frozen LM never receives gradients and is never written to a checkpoint.
"""

from .compressor_stage import CompressorModule, question_features, stage_one_rows, train_compressor
from .data import HandoffDataModule, HandoffRows, collate_rows, prepare_data
from .handoff_stage import HandoffModule, make_memory_source, train_variant
from .pipeline import TrainResult, train
from .reconstruction_stage import ReconstructionModule, train_reconstruction

__all__ = [
    "CompressorModule", "HandoffDataModule", "HandoffModule", "HandoffRows", "TrainResult", "collate_rows",
    "ReconstructionModule", "make_memory_source", "prepare_data", "question_features", "stage_one_rows", "train", "train_compressor",
    "train_reconstruction", "train_variant",
]
