#!/bin/bash
printf '#!/bin/bash\nwc -l < "$1"\n' > /app/count_lines.sh
chmod +x /app/count_lines.sh
