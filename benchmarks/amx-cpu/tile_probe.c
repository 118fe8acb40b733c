// A probe of the tile unit against the vector ports, one thread (results.md): each mode a variant
// of one group's work (tile loads, tilezero, tdpbsud, tilestored, the float steps). gcc -O3
// -mavx512f -mavx512bw -mamx-tile -mamx-int8 tile_probe.c
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
typedef struct { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#define G 18
#define KK (G*32)
static int8_t A[16*KK] __attribute__((aligned(64)));
static uint8_t B[G*8*64] __attribute__((aligned(64))); static uint8_t P[G*4*64] __attribute__((aligned(64))); static uint8_t SC[2][512] __attribute__((aligned(64)));
static int32_t Z[256] __attribute__((aligned(64))); static int32_t T2[256] __attribute__((aligned(64))); static int32_t R4[4][256] __attribute__((aligned(64))); static int32_t S[2][256] __attribute__((aligned(64)));
static float a[16*G], aq[16*G], scale[G*16], mins[G*16];
int mode;
static inline void unpack(int g, uint8_t* rows){ const __m512i low=_mm512_set1_epi8(15);
 for(int m=0;m<4;m++){ __m512i b=_mm512_load_si512(P+(g*4+m)*64); _mm512_store_si512(rows+2*m*64,_mm512_and_si512(b,low)); _mm512_store_si512(rows+(2*m+1)*64,_mm512_and_si512(_mm512_srli_epi16(b,4),low)); } }
#define GRP(C,AT,BT,g,buf) do{ const uint8_t* bb=B+(g)*512; if(mode>=4){ unpack(g,SC[buf]); bb=SC[buf]; } _tile_loadd(AT, A+(g)*32, KK); _tile_loadd(BT, bb, 64); _tile_zero(C); _tile_dpbsud(C,AT,BT); if(mode!=2) _tile_stored(C, S[buf], 64);}while(0)
static inline void fin(int g, const int32_t* s, __m512* y){
  if(mode==1) return;
  __m512 sc=_mm512_loadu_ps(scale+g*16), mn=_mm512_loadu_ps(mins+g*16);
  for(int r=0;r<16;r++){ __m512 aD=_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s+r*16)), _mm512_set1_ps(a[r*G+g]));
    y[r]=_mm512_fmadd_ps(aD,sc,y[r]); y[r]=_mm512_fmadd_ps(_mm512_set1_ps(aq[r*G+g]),mn,y[r]); }
}
int main(int argc,char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  for(int t=0;t<2;t++){c.rows[t]=16;c.colsb[t]=64;c.rows[2+t]=16;c.colsb[2+t]=32;c.rows[4+t]=8;c.colsb[4+t]=64;}
  _tile_loadconfig(&c);
  for(mode=9; mode<15; mode++){
  __m512 y[16]; for(int r=0;r<16;r++) y[r]=_mm512_setzero_ps();
  long N=200000; double t0=now();
  for(long it=0; it<N; it++){
    if(mode==3){ for(int g=0;g<G;g++) fin(g,S[g&1],y); continue; }
    if(mode==7){ for(int g=0;g<G;g+=2){ _tile_loadd(2, A+(g)*32, KK); _tile_loadd(4, B+(g)*512, 64); _tile_dpbsud(0,2,4); fin(g,S[0],y); _tile_loadd(3, A+(g+1)*32, KK); _tile_loadd(5, B+(g+1)*512, 64); _tile_dpbsud(1,3,5); fin(g+1,S[1],y);} continue; }
    if(mode==8){ for(int g=0;g<G;g+=2){ _tile_loadd(4, B+(g)*512, 64); _tile_dpbsud(0,2,4); fin(g,S[0],y); _tile_loadd(5, B+(g+1)*512, 64); _tile_dpbsud(1,3,5); fin(g+1,S[1],y);} continue; }
    if(mode==9){ for(int g=0;g<G;g+=2){ _tile_zero(0); _tile_dpbsud(0,2,4); _tile_stored(0,S[0],64); fin(g,S[1],y); _tile_zero(1); _tile_dpbsud(1,3,5); _tile_stored(1,S[1],64); fin(g+1,S[0],y);} continue; }
    if(mode==10){ for(int g=0;g<G;g+=2){ _tile_loadd(2, A+(g)*32, KK); _tile_loadd(4, B+(g)*512, 64); _tile_loadd(0,Z,64); _tile_dpbsud(0,2,4); _tile_stored(0,S[0],64); fin(g,S[1],y); _tile_loadd(3, A+(g+1)*32, KK); _tile_loadd(5, B+(g+1)*512, 64); _tile_loadd(1,Z,64); _tile_dpbsud(1,3,5); _tile_stored(1,S[1],64); fin(g+1,S[0],y);} continue; }
    if(mode==11){ for(int g=0;g<G;g+=2){ _tile_loadd(2, A+(g)*32, KK); _tile_loadd(4, B+(g)*512, 64); _tile_dpbsud(0,2,4); _tile_stored(0,S[0],64); fin(g,S[1],y); _tile_loadd(3, A+(g+1)*32, KK); _tile_loadd(5, B+(g+1)*512, 64); _tile_dpbsud(1,3,5); _tile_stored(1,S[1],64); fin(g+1,S[0],y);} continue; }
    if(mode==12){ for(int g=0;g<G;g+=2){ _tile_loadd(2, A+(g)*32, KK); _tile_loadd(4, B+(g)*512, 64); _tile_dpbsud(0,2,4); _tile_stored(0,S[0],64); fin(g,T2,y); _tile_loadd(3, A+(g+1)*32, KK); _tile_loadd(5, B+(g+1)*512, 64); _tile_dpbsud(1,3,5); _tile_stored(1,S[1],64); fin(g+1,T2,y);} continue; }
    if(mode==13){ for(int g=0;g<G;g+=2){ _tile_loadd(2, A+(g)*32, KK); _tile_loadd(4, B+(g)*512, 64); _tile_zero(0); _tile_dpbsud(0,2,4); _tile_stored(0,R4[g&3],64); fin(g,R4[(g+1)&3],y); _tile_loadd(3, A+(g+1)*32, KK); _tile_loadd(5, B+(g+1)*512, 64); _tile_zero(1); _tile_dpbsud(1,3,5); _tile_stored(1,R4[(g+1)&3],64); fin(g+1,R4[(g+2)&3],y);} continue; }
    if(mode==14){ for(int g=0;g<G;g+=2){ _tile_loadd(2, A+(g)*32, KK); _tile_loadd(4, B+(g)*512, 64); _tile_zero(0); _tile_dpbsud(0,2,4); _tile_stored(0,S[0],64); fin(g,T2,y); _tile_loadd(3, A+(g+1)*32, KK); _tile_loadd(5, B+(g+1)*512, 64); _tile_zero(1); _tile_dpbsud(1,3,5); _tile_stored(1,S[1],64); fin(g+1,T2,y);} continue; }
    if(mode==5){ for(int g=0;g<G;g+=2){ _tile_dpbsud(0,2,4); fin(g,S[0],y); _tile_dpbsud(1,3,5); fin(g+1,S[1],y);} continue; }
    if(mode==6){ for(int g=0;g<G;g+=2){ _tile_loadd(2, A+(g)*32, KK); _tile_loadd(4, B+(g)*512, 64); fin(g,S[0],y); _tile_loadd(3, A+(g+1)*32, KK); _tile_loadd(5, B+(g+1)*512, 64);fin(g+1,S[1],y);} continue; }
    GRP(0,2,4,0,0);
    for(int g=0; g<G; g+=2){ GRP(1,3,5,g+1,1); fin(g,S[0],y); if(g+2<G) GRP(0,2,4,g+2,0); fin(g+1,S[1],y); }
  }
  double s=now()-t0; float o=0; float tmp[16]; for(int r=0;r<16;r++){_mm512_storeu_ps(tmp,y[r]); o+=tmp[0];}
  printf("mode %d: %.1f ns per unit (16x16x32) %f\n", mode, s/(N*G)*1e9, o);
  }
  return 0; }
