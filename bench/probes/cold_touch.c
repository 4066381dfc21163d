/* The CPU time of reading N MiB (one byte per cache line) after a pause of P us, 300 times:
   gcc -O2 -o /tmp/cold bench/probes/cold_touch.c && /tmp/cold 1 10000
   (docs/benchmarks.md "What a paced call costs on this machine"). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <time.h>
static double now(){struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc,char**argv){ size_t MB=atoi(argv[1]); int us=atoi(argv[2]); size_t n=MB<<20; unsigned char*buf=malloc(n); for(size_t i=0;i<n;i++)buf[i]=i;
 double tot=0; int R=300; volatile unsigned long s=0;
 for(int r=0;r<R;r++){ if(us) usleep(us); double a=now(); for(size_t i=0;i<n;i+=64) s+=buf[i]; tot+=now()-a;}
 printf("%zu MB touch, sleep %d us: %.1f us per pass\n",MB,us,tot/R);}
