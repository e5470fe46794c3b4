"""The source layouts prepare reads: each a folder, a file or a list of images with their labels, as listed samples.

    layouts.py      which layout a folder has (YOLO, VOC, segmentation, shards); segmentation folders
    detection.py    COCO JSON and YOLO labels -> listed samples with boxes
    voc.py          Pascal VOC XML -> listed samples with boxes (no DOCTYPE, no entities)
    yolo_splits.py  YOLO as ultralytics reads it: data.yaml's splits, split folders, image lists (never merged)
    lists.py        a CSV/JSONL list's rows -> listed samples (path, label(s), caption, columns), rows bounded
    tar.py          WebDataset shards (img2dataset's) as a source: samples by key, images by byte range
    common.py       SourceItem, ListingInfo and the checks every format reader shares
"""
