"""A small text data set in MaxText's Grain file types, made here: `make data` (recipes/tiny-grain.yaml reads it)
and the tests' real-data runs. Records are tf.train.Example protos with one bytes feature, `text` (MaxText's
`train_data_columns` default), written as ArrayRecord (Grain's random-access format: shuffling, and a data
position per process that Orbax checkpoints) and as TFRecord (Grain's sequential reader).

The text is English-like sentences drawn from a fixed vocabulary with a seeded generator: the same files,
byte for byte, on every machine, with nothing downloaded. Run in the training environment (array_record and
MaxText's protos): `python -m rkit.recipe.sampledata DIR`.
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
from pathlib import Path

SUBJECTS = ["the cluster", "a node", "the scheduler", "every rank", "the checkpoint", "our model", "the job",
            "a collective", "the supervisor", "the data loader", "each process", "the network", "a researcher"]
VERBS = ["restarts", "saves", "reads", "trains", "waits for", "recovers", "measures", "sends", "keeps", "loses",
         "finds", "writes", "checks", "replaces", "resumes"]
OBJECTS = ["the last committed step", "its own shard of the data", "a gradient", "the loss", "twelve tokens",
           "a time limit", "the next batch", "the optimizer state", "a preemption signal", "the weights",
           "every file it was given", "a healthy spare", "the same sequence of tokens"]
TAILS = ["before the deadline", "without a word", "at every step", "in a few seconds", "after the failure",
         "as the recipe says", "on the shared file system", "twice a day", "with a clear diagnosis", ""]


def documents(count: int, seed: int = 0) -> list[str]:
    """`count` short documents of 2 to 6 sentences, the same for the same seed."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            tail = rng.choice(TAILS)
            sentences.append(f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
                             f"{' ' + tail if tail else ''}.")
        docs.append(f"Document {i}. " + " ".join(sentences))
    return docs


def example(text: str, column: str = "text") -> bytes:
    """One serialized tf.train.Example with a bytes feature (MaxText's own copy of the proto: no TensorFlow)."""
    from maxtext.input_pipeline.protos import example_pb2

    proto = example_pb2.Example()
    proto.features.feature[column].bytes_list.value.append(text.encode())
    return proto.SerializeToString()


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated and offset (the format's 'masked' CRC)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF


def write_tfrecord(path: Path, records: list[bytes]) -> None:
    with open(path, "wb") as fh:
        for record in records:
            length = struct.pack("<Q", len(record))
            fh.write(length + struct.pack("<I", masked_crc32c(length)) + record
                     + struct.pack("<I", masked_crc32c(record)))


def write_array_record(path: Path, records: list[bytes]) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()


def make(directory: Path, documents_per_file: int = 400, files: int = 2, seed: int = 0) -> list[Path]:
    """`files` ArrayRecord files (train-0000N.array_record) and as many TFRecord files (train-0000N.tfrecord)
    of the same documents; written under a temporary name and renamed, so a reader never sees half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    docs = documents(documents_per_file * files, seed)
    written = []
    for n in range(files):
        records = [example(text) for text in docs[n * documents_per_file:(n + 1) * documents_per_file]]
        for suffix, write in (("array_record", write_array_record), ("tfrecord", write_tfrecord)):
            target = directory / f"train-{n:05d}.{suffix}"
            partial = directory / f".{target.name}.partial"
            write(partial, records)
            partial.replace(target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rkit.recipe.sampledata", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--documents", type=int, default=400, help="documents per file (default 400)")
    parser.add_argument("--files", type=int, default=2, help="files of each type (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in make(args.directory, args.documents, args.files, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
