#!/bin/bash
echo done >> /app/notes.txt
