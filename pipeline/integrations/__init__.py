"""Other libraries' own training loops, fed by gpufeed's loaders.

    yolo_batches.py   a YOLO data.yaml's splits prepared once into cached shards, and gpufeed batches in
                      ultralytics' batch contract (`img`, `cls`, `bboxes`, `batch_idx`, `ratio_pad`, ...)
    ultralytics.py    `DetectionTrainer`: ultralytics' own detection trainer whose loaders are gpufeed's
                      (imports ultralytics: the `[yolo]` extra)

Nothing here is imported by the rest of gpufeed; `ultralytics.py` is the
only module that imports ultralytics.
"""
