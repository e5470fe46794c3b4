"""One source -> one sample: its image read and transformed, its targets moved in step with its pixels.

    make.py        one source -> one sample: read, decode or the YCbCr path, transform, encode
    targets.py     a sample's boxes, mask, labels, caption checked and moved with its pixels' geometry
    coco_masks.py  COCO's polygons and RLE painted into a segmentation mask
"""
